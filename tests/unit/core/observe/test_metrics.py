"""The ``observe.metrics_jsonl`` observe patch: exact per-iteration records, megatron's
forward-backward timer, and the outside timer around forward-backward."""

import json

from megatron.patchset.core import argsfile, registry
from megatron.patchset.core.observe import metrics
from tests.unit.conftest import TINY, validated


def metrics_setup(tmp_path, monkeypatch):
    """Metrics on, megatron's args (tiny config) and global batch 16 as training_log sees them."""
    import megatron.core.num_microbatches_calculator as nmc
    import megatron.training

    path = tmp_path / "m.jsonl"
    monkeypatch.setenv("MEGATRON_PATCHSET_METRICS", str(path))
    args = validated(argsfile.read(TINY))
    args.padded_vocab_size = 4096
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(nmc, "get_current_global_batch_size", lambda: 16)
    monkeypatch.setattr(metrics, "_RECORDER", None)
    return path, args


def test_metrics_patch_records_exact_values(tmp_path, monkeypatch):
    """The observe patch wraps training_log, calls the original, and appends exact values."""
    import torch

    path, args = metrics_setup(tmp_path, monkeypatch)

    calls = []

    def fake_training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
        calls.append(iteration)
        return "flag"

    wrapped = registry.get("observe.metrics_jsonl").factory(fake_training_log)
    loss = torch.tensor(2.718281828, dtype=torch.float32)
    for it in (1, 2):
        assert (
            wrapped({"lm loss": loss}, {}, 1e-3, it, 1.0, True, 0, 0.123456789, None, None)
            == "flag"
        )
    assert calls == [1, 2]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert records[0]["losses"]["lm loss"] == loss.item()  # full precision, not the log's 6 digits
    assert records[0]["grad_norm"] == 0.123456789
    assert records[0]["time_s"] is None and records[1]["time_s"] >= 0
    assert records[0]["tokens"] == 16 * 1024 and records[0]["flops"] > 0


def test_metrics_patch_records_megatrons_forward_backward_timer(tmp_path, monkeypatch):
    """With --timing-log-level 1 the record carries the forward-backward timer's value, read before
    training_log (which resets it); without it, no such field."""
    import megatron.training.global_vars as global_vars
    import torch
    from megatron.core.timers import Timers

    path, args = metrics_setup(tmp_path, monkeypatch)
    timers = Timers(1, "max")
    monkeypatch.setattr(global_vars, "get_timers", lambda: timers)

    def fake_training_log(*a, **k):  # megatron's training_log resets the timers it logs
        timers("forward-backward").reset()

    wrapped = registry.get("observe.metrics_jsonl").factory(fake_training_log)
    loss = torch.tensor(1.0)
    args.timing_log_level = 0
    wrapped({"lm loss": loss}, {}, 1e-3, 1, 1.0, True, 0, 0.5, None, None)
    args.timing_log_level = 1
    timers("forward-backward", log_level=1).set_elapsed(0.25)
    wrapped({"lm loss": loss}, {}, 1e-3, 2, 1.0, True, 0, 0.5, None, None)
    args.log_interval = 2  # the timer would sum two iterations: not recorded
    timers("forward-backward").set_elapsed(0.5)
    wrapped({"lm loss": loss}, {}, 1e-3, 3, 1.0, True, 0, 0.5, None, None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert ["fwd_bwd_s" in r for r in records] == [False, True, False]
    assert records[1]["fwd_bwd_s"] == 0.25


def test_forward_backward_timed_around_the_call(monkeypatch):
    """MEGATRON_PATCHSET_TIME_FWD_BWD=1: the train_step patch wraps the forward-backward function it
    is handed (a full-iteration graph wrapper included) in a timer between two synchronisations;
    the calls of one iteration add up and the metrics take the sum once."""
    import time as time_module

    import torch

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setenv(metrics.FWD_BWD_ENV, "1")
    monkeypatch.delenv("MEGATRON_PATCHSET_PROFILE", raising=False)
    patch = registry.get("observe.train_step")
    assert patch.wanted(None) and patch.kind == "observe"

    def forward_backward(**kwargs):
        time_module.sleep(0.02)
        return ["losses"]

    def fake_train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):
        assert forward_backward_func is not forward_backward  # wrapped
        return [forward_backward_func(forward_only=False) for _ in range(2)]  # e.g. a re-run

    metrics._fwd_bwd["seconds"] = None
    step = patch.factory(fake_train_step)
    assert step(None, None, None, None, None, None, forward_backward, iteration=0) == [
        ["losses"],
        ["losses"],
    ]
    assert len(syncs) == 4
    seconds = metrics.forward_backward_seconds()
    assert 0.04 <= seconds < 1.0
    assert metrics.forward_backward_seconds() is None  # taken once per iteration
    monkeypatch.setenv(metrics.FWD_BWD_ENV, "0")
    assert not patch.wanted(None)
