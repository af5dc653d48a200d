"""The ``observe.train_step`` observe patch: the one-iteration wrapper, the labels, and
one profiled step of the tiny local-spec MoE GPT on the CPU."""

import json
import os
import types

import pytest
import torch.multiprocessing as mp

from megatron.patchset.core import registry
from megatron.patchset.core.observe import labels, profile, trace_summary
from tests.unit.support.cpu_train import cpu_argv, free_port


def test_pipeline_calls_are_labelled_by_direction():
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    directions = {
        attr: detail
        for module, owner, attr, category, detail, _ in labels._METHOD_LABELS
        if category == "p2p"
    }
    assert directions["send_backward_recv_backward"] == "backward"
    assert directions["send_forward_recv_forward"] == "forward"
    assert directions["send_forward_backward_recv_forward_backward"] == "both"
    assert len(directions) == 9 and all(hasattr(P2PCommunicator, name) for name in directions)
    original = P2PCommunicator.send_backward_recv_backward
    installed = labels.Labels()
    try:
        assert P2PCommunicator.send_backward_recv_backward is not original
        assert P2PCommunicator.send_backward_recv_backward.__wrapped__ is original
    finally:
        installed.remove()
    assert P2PCommunicator.send_backward_recv_backward is original
    assert profile.rank_folder("/p", 0) == "/p" and profile.rank_folder("/p", 3) == "/p/rank3"


def test_patch_is_registered_as_observe_on_train_step(monkeypatch):
    patch = registry.get("observe.train_step")
    assert patch.kind == "observe" and patch.target == "megatron.training.training.train_step"
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    assert not patch.wanted(None)
    monkeypatch.setenv(profile.PROFILE_ENV, "x:3")
    assert patch.wanted(None)


def test_wrapper_profiles_exactly_the_requested_iteration_with_labels_from_the_start(
    tmp_path, monkeypatch
):
    import torch
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    monkeypatch.setenv(profile.PROFILE_ENV, f"{tmp_path}:2")
    route, permute = moe_layer.MoELayer.route, token_dispatcher.permute
    seen = []

    class Opt:
        def step(self):
            seen.append(("step",))
            return torch.ones(4).sum()

    def finalize(*a):
        return "final"

    def fake_train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        scheduler,
        config,
        forward_backward_func,
        iteration=None,
        pg_collection=None,
    ):
        labelled = moe_layer.MoELayer.route is not route
        seen.append(
            (iteration, labelled, token_dispatcher.permute is not permute, labels.RECORDING[0])
        )
        optimizer.step()
        config.finalize_model_grads_func()
        return f"result {iteration}"

    opt, config = Opt(), types.SimpleNamespace(finalize_model_grads_func=finalize)
    wrapped = registry.get("observe.train_step").factory(fake_train_step)
    try:
        results = [
            wrapped(None, None, None, opt, None, config, None, iteration=i) for i in range(3)
        ]
    finally:
        profile.remove_labels()
    assert results == ["result 0", "result 1", "result 2"]
    its = [s for s in seen if s[0] != "step"]
    # Labels installed from the first iteration on (compiled layers must never see methods
    # change), recording only in the profiled one (iteration 2 = iteration=1).
    assert its == [(0, True, True, False), (1, True, True, True), (2, True, True, False)]
    assert moe_layer.MoELayer.route is route and token_dispatcher.permute is permute
    assert "step" not in vars(opt) and config.finalize_model_grads_func is finalize
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["iteration"] == 2
    assert summary["categories"]["optimizer"]["host_ms"] > 0
    assert summary["categories"]["grad_sync"]["host_ms"] > 0
    assert (tmp_path / "trace.json").exists()


def profiled_worker(rank, argv, port, folder, steps):
    """pretrain_gpt.py's model, data, forward_step and loss on the CPU, with a train step of
    megatron's signature wrapped by the patch (megatron's own train_step needs a GPU)."""
    os.environ.update(
        WORLD_SIZE="1",
        RANK="0",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{profile.PROFILE_ENV: f"{folder}:{steps}"},
    )
    import sys

    import pytest as _pytest
    import torch

    from tests.unit.support import cpu_shims

    cpu_shims.install(_pytest.MonkeyPatch())
    sys.argv = ["pretrain_gpt.py", *argv]
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_layer
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt

    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_config = pretrain_gpt.model_config_from_args(args)
    model = GPTModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([16, 0, 0])
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    route = moe_layer.MoELayer.route

    def train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
        pg_collection=None,
    ):
        output, loss_fn = forward_step_func(data_iterator, model)
        loss, num_tokens, _ = loss_fn(output)
        (loss / num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss / num_tokens)

    step = registry.get("observe.train_step").factory(train_step)
    for i in range(steps):
        step(
            pretrain_gpt.forward_step,
            iter([batch]),
            model,
            optimizer,
            None,
            model.config,
            None,
            iteration=i,
        )
    installed = moe_layer.MoELayer.route is not route
    profile.remove_labels()
    with open(os.path.join(folder, "after.json"), "w") as handle:
        json.dump(
            {
                "installed_for_the_run": installed,
                "route_restored": moe_layer.MoELayer.route is route,
            },
            handle,
        )
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_one_profiled_step_of_the_tiny_moe_on_cpu(tmp_path):

    argv = cpu_argv("--global-batch-size", "2", "--micro-batch-size", "1")
    mp.spawn(profiled_worker, args=(argv, free_port(), str(tmp_path), 2), nprocs=1, join=True)
    summary = json.load(open(tmp_path / "summary.json"))
    after = json.load(open(tmp_path / "after.json"))
    assert after["installed_for_the_run"] and after["route_restored"]
    assert summary["iteration"] == 2 and (tmp_path / "trace.json").stat().st_size > 0
    cats = summary["categories"]
    for name in (
        "attention",
        "router",
        "dispatch",
        "permutation",
        "expert",
        "combine",
        "optimizer",
    ):
        assert cats[name]["host_ms"] > 0, name
    # backward nodes found their forward stage through the sequence numbers
    for name in ("attention", "router", "expert"):
        assert cats[name]["bwd_host_ms"] > 0, name
    assert sum(c["host_ms"] for c in cats.values()) == pytest.approx(
        summary["step_host_ms"], rel=1e-6
    )
    assert summary["gpu_events"] == 0 and summary["kernel_launches"] == 0
    # four MoE layers, each with its own router and experts
    assert sorted(summary["layers"], key=int) == ["1", "2", "3", "4"]
    assert all(v["router"] > 0 and v["expert"] > 0 for v in summary["layers"].values())
    text = trace_summary.format_summary(summary)
    assert "token dispatch" in text and "no CUDA activity" in text


def test_labels_record_only_while_profiling_and_are_transparent_to_dynamo(monkeypatch):
    """Installed from the first iteration, the labels change nothing a compiled function guards
    on: compiling through one and then recording with it is not a recompile."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    recorded = []

    class Recorder:
        def __init__(self, name):
            recorded.append(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def work(x):
        return x * 2 + 1

    labelled = labels._labelled(work, "router", "", sets_layer=False)
    region = labels._labelled(torch.compiler.disable(work), "dispatch", "", sets_layer=False)
    monkeypatch.setattr(torch.profiler, "record_function", Recorder)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda t: region(labelled(t)) - 1, backend="eager")
    x = torch.ones(3)
    try:
        assert torch.equal(compiled(x), torch.full((3,), 6.0))
        assert recorded == []  # not recording
        labels.RECORDING[0] = True
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(compiled(x), torch.full((3,), 6.0))
        # The compiled part carries no label; the compile-disabled region runs eagerly, labelled.
        assert recorded == [labels.label("dispatch", "", None)]
        assert labelled(x).tolist() == [3.0] * 3 and recorded[-1] == labels.label(
            "router", "", None
        )
    finally:
        labels.RECORDING[0] = False
        torch._dynamo.reset()
