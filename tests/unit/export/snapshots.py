"""The Megatron-LM snapshots the series tests share, and what they run there.

``MEGATRON_LM_SNAPSHOTS`` (by default ``../shared/upstream`` beside this repository) holds
snapshots of core_r0.19.0 and main that its ``checkout.sh`` makes git checkouts. Each branch gets,
once per pytest run (``tests/unit/export/conftest.py``):

* :class:`Trees`: an unedited checkout, one with the whole series applied by ``git am -3``, and
  one with only what the series adds as new files and its edits of upstream's tests (none of its
  edits of upstream's code);
* one pytest run of upstream's CPU tests and every change's tests on the edited tree, and one of
  the changes' tests on the tree without the code edits (:func:`run_pytest`);
* one run of megatron's parser and ``validate_args`` over every configuration the tests compare,
  on the unedited and the edited tree (:data:`PARSE`).

The expensive work (importing megatron in a subprocess) happens once per tree and branch; each
test module reads its own part of the outcomes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron.patchset.export import changes, edits
from tests.unit.conftest import ROOT

SNAPSHOTS = os.environ.get(
    "MEGATRON_LM_SNAPSHOTS", os.path.join(os.path.dirname(ROOT), "shared", "upstream")
)
BRANCHES = ("core_r0.19.0", "main")
AUTHOR = "Jane Doe <jane@example.com>"
DATE = "2026-11-27T12:00:00+00:00"
# What would give away the fork in an upstream patch (``\b_enable_``: upstream has names such as
# megatron_fsdp_enable_fine_grained_param_gather)
LEAKS = re.compile(
    r"patchset|PATCHSET|fork\b|>>>|noreply|1970|--moe-static-dispatch|--adam-impl|tools/bench|"
    r"features/|\b_enable_",
    re.IGNORECASE,
)
TIMEOUT = 900
# upstream's own tests of the arguments and of ModelParallelConfig that run on CPU
UPSTREAM_CPU_TESTS = (
    "tests/unit_tests/test_argument_utils.py",
    "tests/unit_tests/test_model_parallel_config.py",
)
PYTEST = ("-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest")

needs_snapshots = pytest.mark.skipif(
    not os.path.isfile(os.path.join(SNAPSHOTS, "checkout.sh")),
    reason=f"no Megatron-LM snapshots at {SNAPSHOTS} (set MEGATRON_LM_SNAPSHOTS)",
)
# Every test on the snapshots, for a test module's ``pytestmark``: skipped without them, and in one
# pytest-xdist worker (``--dist loadgroup``), so that each tree is built and run once.
MARKS = [needs_snapshots, pytest.mark.xdist_group("megatron-lm-snapshots")]


def checkout(branch, dest) -> str:
    subprocess.run(
        ["bash", os.path.join(SNAPSHOTS, "checkout.sh"), branch, str(dest)],
        check=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    return str(dest)


def export(tree, out, *extra, seed="0"):
    """``python -m megatron.patchset export --series`` onto ``tree``."""
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_PATCHSET"}
    env |= {"PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
    argv = ["--series", "--megatron-lm", tree, "--out", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "megatron.patchset", "export", *argv, *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=TIMEOUT,
    )


def in_tree(tree, *argv, interpret=False, world_size=None):
    """``python ARGV`` with ``tree`` (a Megatron-LM checkout) first on the path (and Triton's
    interpreter on with ``interpret``, megatron's world size with ``world_size``)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MEGATRON_PATCHSET", "TRITON_INTERPRET")
    }
    env["PYTHONPATH"] = tree
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if world_size:
        env |= {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=tree, env=env, timeout=TIMEOUT
    )


def git(tree, *argv):
    ident = ["-c", "user.name=Reviewer", "-c", "user.email=reviewer@example.com"]
    return subprocess.run(
        ["git", "-C", tree, *ident, *argv], capture_output=True, text=True, timeout=TIMEOUT
    )


def is_test(path: str) -> bool:
    return path.startswith("tests/")


def changed_test_files() -> list[str]:
    """The upstream test files the series adds or edits, in series order."""
    paths = (e.path for change in changes.series() for e in change.edits if is_test(e.path))
    return list(dict.fromkeys(paths))


def without_code_edits(plain: str, dest) -> str:
    """A copy of ``plain`` with the series' new files and its edits of upstream's tests, none of
    its edits of upstream's code: the tests of an in-place edit fail there."""
    tree = str(shutil.copytree(plain, dest, symlinks=True))
    for change in changes.series():
        for edit in change.edits:
            path = os.path.join(tree, edit.path)
            if isinstance(edit, edits.NewFile):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as handle:
                    handle.write(edit.text())
            elif is_test(edit.path):
                with open(path) as handle:
                    source = handle.read()
                with open(path, "w") as handle:
                    handle.write(edits.apply_to_source(source, edit))
    return tree


OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)


@dataclasses.dataclass
class Outcomes:
    """One pytest run with ``-rA``: each test's outcome by node id, and the run's output."""

    by_test: dict
    output: str

    def of(self, pattern: str) -> dict:
        """{node id: outcome} of the tests whose id matches ``pattern`` (a regex)."""
        return {k: v for k, v in self.by_test.items() if re.search(pattern, k)}

    def counts(self, pattern: str) -> dict:
        found: dict = {}
        for outcome in self.of(pattern).values():
            found[outcome] = found.get(outcome, 0) + 1
        return found


def run_pytest(tree, *paths) -> Outcomes:
    """Upstream's tests ``paths`` on ``tree`` under Triton's interpreter (kernels run on CPU)."""
    run = in_tree(tree, *PYTEST, *paths, interpret=True)
    output = run.stdout + run.stderr
    by_test = {}
    for outcome, node in OUTCOME.findall(output):
        by_test.setdefault(node, outcome)
    return Outcomes(by_test, output)


@dataclasses.dataclass
class Trees:
    branch: str
    plain: str  # the snapshot, unedited
    edited: str  # the series applied by git am -3
    patches: list  # the patch files, in order
    tests_only: str  # new files and test edits, no code edit


PARSE = """
import contextlib, io, json, os, sys, types
import torch
# as on one Hopper GPU: validate_args reads the device's compute capability
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    major=9, minor=0, name="H100", total_memory=80 << 30, multi_processor_count=132
)
torch.cuda.device_count = lambda: 1
from megatron.training.arguments import parse_args, validate_args
from megatron.training.training import get_megatron_optimizer_config
target, runs, out = sys.argv[1], json.load(open(sys.argv[2])), {}
for name, words in runs.items():
    sys.argv = ["pretrain_gpt.py", *words]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
            config, _ = get_megatron_optimizer_config(args)
        out[name] = {
            "args": {k: repr(v) for k, v in sorted(vars(args).items())},
            "optimizer": {k: repr(v) for k, v in sorted(vars(config).items()) if k != "timers"},
        }
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
json.dump(out, open(target, "w"))
"""


def parse_runs(tree, runs: dict, folder) -> dict:
    """{run: {"args", "optimizer"} or the error} of megatron's parser, ``validate_args`` and
    ``get_megatron_optimizer_config`` on ``tree``, for each run's command-line words."""
    os.makedirs(folder, exist_ok=True)
    source, target = os.path.join(folder, "runs.json"), os.path.join(folder, "parsed.json")
    with open(source, "w") as handle:
        json.dump(runs, handle)
    run = in_tree(tree, "-c", PARSE, target, source, world_size=1)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(target) as handle:
        return json.load(handle)


def config_words(name: str) -> list[str]:
    """An example config's flags, its comments dropped."""
    with open(os.path.join(ROOT, "examples", "configs", name)) as handle:
        return [w for line in handle for w in line.split("#")[0].split()]


# The runs compared on the unedited and the edited tree (upstream flags only, or a change's own
# flags where the test says so): each example config with each of VARIANTS, then the runs of
# single changes on a small model.
VARIANTS = {
    "plain": [],
    "ce_fusion": ["--cross-entropy-loss-fusion"],
    "ce_fusion_te": ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
    "dist_opt": ["--use-distributed-optimizer"],
    "full_iteration": ["--cuda-graph-impl", "full_iteration"],
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep4": ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"],
}
EXAMPLE_CONFIGS = sorted(
    n for n in os.listdir(os.path.join(ROOT, "examples", "configs")) if n.endswith(".args")
)
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
SMALL += ["--seq-length", "128", "--max-position-embeddings", "128"]
SMALL += ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--bf16"]
SMALL += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
CHANGE_RUNS = {
    # fsdp_cuda_graphs: Megatron-FSDP without TE per-layer graphs, and TE graphs without FSDP
    "fsdp": SMALL + FSDP,
    "fsdp_graphs_local": SMALL + FSDP + ["--cuda-graph-impl", "local"],
    "fsdp_full_iteration": SMALL + FSDP + ["--cuda-graph-impl", "full_iteration"],
    "ddp_te_graphs": SMALL + ["--cuda-graph-impl", "transformer_engine"],
    # torch_adam: its flag, and with the distributed optimizer
    "adam_torch": config_words("tiny_moe.args")
    + ["--adam-fusion-impl", "torch", "--optimizer-cuda-graph"],
    "adam_triton_dist_opt": config_words("tiny_moe.args")
    + ["--adam-fusion-impl", "triton", "--use-distributed-optimizer"],
}


def all_config_runs() -> dict:
    runs = {
        f"{config}:{variant}": config_words(config) + extra
        for config in EXAMPLE_CONFIGS
        for variant, extra in VARIANTS.items()
    }
    runs.update(CHANGE_RUNS)
    return runs


# The arguments and optimizer-config fields a change of the series adds to upstream, with their
# defaults: a run without the change's flags must hold exactly these on the edited tree.
DEFAULTS_OF_NEW_ARGUMENTS = {
    "adam_fusion_impl": "auto",
    "moe_grouped_gemm_impl": "te",
    "moe_expert_splits_on_device": False,
    "ddp_scale_gradients_in_loss": False,
    "moe_swiglu_triton": False,
}


def as_before(parsed: dict, names) -> tuple[dict, dict]:
    """The runs ``names`` of :func:`parse_runs` on the unedited and the edited tree, the edited
    ones without the arguments the series adds (copies; each must be at its default)."""
    plain = {n: parsed["plain"][n] for n in names}
    edited = copy.deepcopy({n: parsed["edited"][n] for n in names})
    for name, run in edited.items():
        if not isinstance(run, dict) or not isinstance(plain[name], dict):
            continue
        for part in ("args", "optimizer"):
            for key in [k for k in run[part] if k not in plain[name][part]]:
                value = run[part].pop(key)
                assert value == repr(DEFAULTS_OF_NEW_ARGUMENTS.get(key, "<not declared>")), (
                    name,
                    key,
                    value,
                )
    return plain, edited
