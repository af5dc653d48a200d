"""The checkpoint check of ``--load`` on a real checkpoint: megatron's ``save_checkpoint`` writes
one (iterations 10 and 20) on the CPU once for the module; each test corrupts a copy. Every bad
checkpoint is refused with one line naming the file and the last complete iteration, in the
dry-run (exit 2) and at launch (exit 1), without a traceback; a save that did not finish leaves
the previous checkpoint to load, and megatron loads it."""

import io
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch.multiprocessing as mp

from megatron.patchset.core import checkpoint_check, dry_run
from megatron.patchset.core.preflight import PreflightError
from tests.unit.conftest import ROOT
from tests.unit.support import cpu_checkpoint, cpu_train

# Its module fixtures are built once: every test of the module runs in one xdist worker.
pytestmark = pytest.mark.xdist_group("checkpoint-check")

TRACKER = "latest_checkpointed_iteration.txt"
SHARD = "__0_0.distcp"


def spawn(out, argv, mode, iterations=()):
    mp.spawn(
        cpu_checkpoint.run,
        args=(1, argv, cpu_train.free_port(), str(out), mode, list(iterations)),
        nprocs=1,
        join=True,
    )
    with open(f"{out}.json") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, {iteration: weight sum}) of a checkpoint that megatron saved at 10 and 20."""
    base = tmp_path_factory.mktemp("saved")
    folder = base / "checkpoint"
    record = spawn(base / "save", cpu_checkpoint.checkpoint_argv(folder), "save", (10, 20))
    return folder, {int(k): v for k, v in record["sums"].items()}


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of the saved checkpoint for one test to change."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(saved[0], folder)
    return folder


def args_for(folder, **extra):
    fields = dict(
        load=str(folder),
        save=None,
        ckpt_step=None,
        load_allow_missing=False,
        exit_on_missing_checkpoint=False,
        pretrained_checkpoint=None,
        non_persistent_ckpt_type=None,
    )
    fields.update(extra)
    return types.SimpleNamespace(**fields)


def refusal(folder, **extra):
    with pytest.raises(PreflightError) as err:
        checkpoint_check.check(args_for(folder, **extra), read_metadata=True)
    text = str(err.value)
    assert "\n" not in text
    return text


def truncate(path, size=1000):
    os.truncate(path, size)


# Each corruption of the copy, and what its message must name.
def _truncated_shard(folder):
    truncate(folder / "iter_0000020" / SHARD)
    return str(folder / "iter_0000020" / SHARD)


def _truncated_metadata(folder):
    truncate(folder / "iter_0000020" / ".metadata", 500)
    return str(folder / "iter_0000020" / ".metadata")


def _garbage_tracker(folder):
    (folder / TRACKER).write_text("twenty\n")
    return str(folder / TRACKER)


def _tracker_names_a_missing_iteration(folder):
    (folder / TRACKER).write_text("30")
    return str(folder / "iter_0000030")


CORRUPTIONS = {
    "truncated shard": _truncated_shard,
    "truncated metadata": _truncated_metadata,
    "garbage tracker": _garbage_tracker,
    "missing iteration": _tracker_names_a_missing_iteration,
}


def test_a_whole_checkpoint_passes_and_names_what_is_loaded(ckpt):
    line = checkpoint_check.check(args_for(ckpt), read_metadata=True)
    assert line == f"--load {ckpt}: iteration 20, files complete ({ckpt}/iter_0000020)"
    assert checkpoint_check.checkpoint_problem(str(ckpt / "iter_0000010")) is None


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_bad_latest_checkpoint_names_the_file_and_the_last_complete_iteration(ckpt, case):
    named = CORRUPTIONS[case](ckpt)
    text = refusal(ckpt)
    assert text.startswith(f"megatron-patchset: --load {ckpt}")
    assert named in text
    # iteration 20 is the bad one (or the tracker is), 10 is whole; with a garbage tracker or a
    # missing folder 20 itself is complete
    good = 20 if case in ("garbage tracker", "missing iteration") else 10
    assert f"the last complete checkpoint is iteration {good}: pass --ckpt-step {good}" in text


def test_a_truncated_shard_states_both_sizes(ckpt):
    whole = os.path.getsize(ckpt / "iter_0000020" / SHARD)
    _truncated_shard(ckpt)
    text = refusal(ckpt)
    assert f"is 1,000 bytes, but {ckpt}/iter_0000020/.metadata places {whole:,} bytes" in text


def test_no_complete_iteration_left_is_said(ckpt):
    truncate(ckpt / "iter_0000020" / SHARD)
    os.remove(ckpt / "iter_0000010" / ".metadata")
    text = refusal(ckpt)
    assert f"no other iteration in {ckpt} is complete" in text


def test_ckpt_step_chooses_the_iteration_checked(ckpt):
    _truncated_shard(ckpt)
    line = checkpoint_check.check(args_for(ckpt, ckpt_step=10), read_metadata=True)
    assert "iteration 10, files complete" in line
    assert "iter_0000005" in refusal(ckpt, ckpt_step=5)


def test_a_missing_load_folder_is_refused_unless_a_fresh_start_is_meant(tmp_path):
    missing = tmp_path / "no-such"
    text = refusal(missing)
    assert text == (
        f"megatron-patchset: --load {missing} does not exist: there is no checkpoint to load. "
        "Check the path; to "
        "start from random weights on purpose, pass --load-allow-missing."
    )
    for extra in ({"load_allow_missing": True}, {"save": str(missing)}):
        line = checkpoint_check.check(args_for(missing, **extra), read_metadata=True)
        assert line.endswith("no checkpoint yet, the run starts from random weights")
    assert "--exit-on-missing-checkpoint" in refusal(
        missing, load_allow_missing=True, exit_on_missing_checkpoint=True
    )


def test_a_folder_without_tracker_but_with_a_checkpoint_is_refused(ckpt):
    os.remove(ckpt / TRACKER)
    # also when --load is --save: a fresh start would ignore the checkpoint
    text = refusal(ckpt, save=str(ckpt))
    assert f"holds no {TRACKER}" in text and "pass --ckpt-step 20" in text


def test_other_ranks_read_no_metadata(ckpt):
    _truncated_shard(ckpt)
    line = checkpoint_check.check(args_for(ckpt), read_metadata=False)
    assert line == f"--load {ckpt}: iteration 20 ({ckpt}/iter_0000020)"


def test_legacy_torch_files_are_checked_by_their_zip_directory(tmp_path):
    import torch

    folder = tmp_path / "legacy"
    rank = folder / "iter_0000005" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"iteration": 5, "model": {"w": torch.ones(1000)}}, rank / "model_optim_rng.pt")
    (folder / TRACKER).write_text("5")
    assert "files complete" in checkpoint_check.check(args_for(folder), read_metadata=True)
    truncate(rank / "model_optim_rng.pt", 100)
    assert f"{rank}/model_optim_rng.pt is truncated" in refusal(folder)


def cpu_flags(folder, *extra):
    return cpu_checkpoint.checkpoint_argv(folder, *extra)


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_the_dry_run_refuses_a_bad_checkpoint(ckpt, case):
    named = CORRUPTIONS[case](ckpt)
    out = io.StringIO()
    code = dry_run.run(cpu_flags(ckpt), out=out)
    lines = out.getvalue().strip().splitlines()
    assert code == 2 and lines[-1] == "dry-run: INVALID", out.getvalue()
    assert named in lines[-2] and "Traceback" not in out.getvalue()


def test_the_dry_run_names_the_checkpoint_it_would_load(ckpt):
    out = io.StringIO()
    assert dry_run.run(cpu_flags(ckpt), out=out) == 0, out.getvalue()
    assert f"checkpoint: --load {ckpt}: iteration 20, files complete" in out.getvalue()


def launch(*argv):
    environ = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CORRUPTIONS) + ["missing folder"])
def test_the_launch_refuses_a_bad_checkpoint_before_it_starts(ckpt, tmp_path, case):
    if case == "missing folder":
        folder = tmp_path / "typo"
        argv = cpu_flags(ckpt)
        argv[argv.index("--load") + 1] = str(folder)
        named = str(folder)
    else:
        named = CORRUPTIONS[case](ckpt)
        argv = cpu_flags(ckpt)
    proc = launch(*argv)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-patchset: --load ") and named in last
    assert "Traceback" not in proc.stderr
    assert "needs an NVIDIA GPU" not in proc.stderr  # refused before the GPU check


@pytest.mark.slow
def test_a_resume_after_an_unfinished_save_loads_the_last_complete_checkpoint(saved, ckpt):
    """A save killed half-way leaves iter_0000030 with a truncated shard and no .metadata, and the
    tracker naming 20 (megatron writes it last): the launch's check passes, says so, and megatron
    loads iteration 20."""
    _, sums = saved
    unfinished = ckpt / "iter_0000030"
    unfinished.mkdir()
    shutil.copy(ckpt / "iter_0000020" / SHARD, unfinished / SHARD)
    truncate(unfinished / SHARD, 4096)
    record = spawn(ckpt.parent / "load", cpu_flags(ckpt), "load")
    assert "iteration 20, files complete" in record["check"]
    assert "does not load the newer" in record["check"] and str(unfinished) in record["check"]
    assert record["iteration"] == 20
    assert record["sum"] == sums[20] != sums[10]
    assert record["before"] != record["sum"]


@pytest.mark.slow
def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(saved, tmp_path):
    """The saving process dies (status 137, no cleanup) in its third save, after the shards and
    before the .metadata and the tracker: the check names iteration 20 and the newer folder, and
    megatron loads iteration 20's weights (the same seed and steps as the ``saved`` run's)."""
    folder = tmp_path / "checkpoint"
    with pytest.raises(mp.ProcessExitedException, match="exit code 137|exitcode 137|137"):
        spawn(tmp_path / "save", cpu_checkpoint.checkpoint_argv(folder), "killed", (10, 20, 30))
    assert (folder / TRACKER).read_text().strip() == "20"
    assert (folder / "iter_0000030").is_dir()
    assert not (folder / "iter_0000030" / ".metadata").exists()
    record = spawn(tmp_path / "load", cpu_flags(folder), "load")
    assert "iteration 20, files complete" in record["check"]
    assert str(folder / "iter_0000030") in record["check"]
    assert record["iteration"] == 20 and record["sum"] == saved[1][20] != record["before"]


def test_megatrons_exit_on_a_load_error_is_non_zero(tmp_path):
    """megatron's tracker reader ends with sys.exit() on a value it cannot parse; the compat patch
    makes the status 1."""
    from megatron.training import checkpointing

    from megatron.patchset.core import registry

    tracker = tmp_path / TRACKER
    tracker.write_text("garbage")
    applied = registry.apply_patches([registry.get("compat.checkpoint_exit_status")])
    try:
        with pytest.raises(SystemExit) as exc:
            checkpointing.read_metadata(str(tracker))
        assert exc.value.code not in (None, 0)
        assert "stopped loading the checkpoint" in str(exc.value.code)
        assert checkpointing.sys.argv is sys.argv  # every other name is the real module's
    finally:
        registry.revert(applied)
    assert checkpointing.sys is sys
    with pytest.raises(SystemExit) as exc:  # upstream: status 0
        checkpointing.read_metadata(str(tracker))
    assert exc.value.code is None
