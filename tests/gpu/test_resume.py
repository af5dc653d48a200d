"""A resumed run continues exactly: 20 iterations in one go against ``--exit-interval 10 --save``
and a second launch with ``--load``; iterations 11-20 have the same losses and gradient norms to
the last bit (``--deterministic-mode``), through pretrain_gpt.py on one GPU. For plain training,
the small_batch recipe (docs/recipes.md) without its kernels, with torch's fused Adam captured
too (``--adam-impl torch --optimizer-cuda-graph``), whole (the one-kernel Adam step captured),
and whole with megatron's distributed optimizer (each without the fused cross entropy, which
``--deterministic-mode`` refuses); the fsdp_cuda_graphs recipe (Megatron-FSDP with TE per-layer
graphs) and the compile recipe (per-layer torch.compile); the offload API's harness saves after
an offload/reload cycle and reloads right after loading. All runs of a stage start at once
(they share the GPU): this checks numerics, not time."""

import os

import pytest

from megatron.patchset import recipes
from megatron.patchset.core import argsfile
from tests.gpu.conftest import (
    DETERMINISTIC,
    ROOT,
    assert_resumed_exactly,
    first_difference,
    launch,
    launch_many,
    tiny_argv,
)

pytestmark = pytest.mark.gpu

ITERS, EXIT = 20, 10
NUMERICS = (*DETERMINISTIC, "--train-iters", str(ITERS))


def deterministic(flags):
    """A recipe's flags as --deterministic-mode takes them: megatron refuses its fused cross
    entropy there, and with it the fork's Triton one, which replaces it."""
    for flag in ("--cross-entropy-loss-fusion", "--cross-entropy-triton"):
        flags = argsfile.remove(list(flags), flag)
    return tuple(flags)


RECIPES = {
    "plain": ((), {}),
    # the small_batch recipe without its kernels, with torch's Adam captured, and whole
    "full_iteration": (
        deterministic(recipes.flags("small_batch", KERNELS=0, OPTIMIZER_GRAPH=0)),
        {},
    ),
    "full_iteration_torch_adam_graph": (
        (*deterministic(recipes.flags("small_batch", KERNELS=0)), "--adam-impl", "torch"),
        {},
    ),
    "full_iteration_triton_adam_graph": (deterministic(recipes.flags("small_batch")), {}),
    # the same with megatron's distributed optimizer (one data-parallel rank: the shard is the
    # whole) and its torch_dist checkpoint
    "full_iteration_triton_adam_graph_distopt": (
        deterministic(recipes.flags("small_batch", DIST_OPT=1)),
        {},
    ),
    "fsdp_te_graphs": (
        recipes.get("fsdp_cuda_graphs")(SCOPES="attn").flags,
        dict(recipes.get("fsdp_cuda_graphs")().env),
    ),
    "compile": (recipes.flags("compile"), {}),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    first, second = [], []
    for name, (flags, env) in RECIPES.items():
        argv = tiny_argv(*NUMERICS, *flags)
        ckpt = str(tmp / f"ckpt_{name}")
        first.append(dict(tmp_path=tmp, name=f"{name}_full", nproc=1, argv=argv, env=env))
        first.append(
            dict(
                tmp_path=tmp,
                name=f"{name}_first",
                nproc=1,
                env=env,
                argv=argv
                + ["--save", ckpt, "--save-interval", str(EXIT), "--exit-interval", str(EXIT)],
            )
        )
        second.append(
            dict(
                tmp_path=tmp,
                name=f"{name}_resumed",
                nproc=1,
                env=env,
                argv=argv + ["--load", ckpt],
            )
        )
    runs = launch_many(first)
    runs.update(launch_many(second))
    return runs


@pytest.mark.gpus(1)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_iterations_after_the_checkpoint_are_bit_identical(resumed, recipe):
    full, first, again = (resumed[f"{recipe}_{s}"] for s in ("full", "first", "resumed"))
    assert len(full.iterations) == ITERS
    assert_resumed_exactly(full, first, again, EXIT)
    print(
        f"\n{recipe}: iterations {EXIT + 1}-{ITERS} resumed bit-identically; loss at "
        f"{ITERS} {again.losses[-1]!r}, grad norm {again.grad_norms[-1]!r}"
    )


@pytest.mark.gpus(1)
def test_offload_api_checkpoint_after_offload_and_reload_resumes_exactly(tmp_path):
    harness = os.path.join(ROOT, "tests", "gpu", "harness", "offload.py")
    argv = tiny_argv(*NUMERICS, "--use-distributed-optimizer")
    ckpt = str(tmp_path / "ckpt")
    run = launch(
        tmp_path,
        "offload_resume",
        1,
        argv,
        entry=[harness],
        env={"OFFLOAD_MODES": "offload,save", "OFFLOAD_CHECKPOINT": ckpt},
    )
    again = launch(
        tmp_path,
        "offload_load",
        1,
        argv,
        entry=[harness],
        env={"OFFLOAD_MODES": "load", "OFFLOAD_CHECKPOINT": ckpt},
    )
    by_mode = {}
    for record in run.records + again.records:
        if "iteration" in record:
            by_mode.setdefault(record["mode"], []).append(record)
    offloaded = [r["losses"]["lm loss"] for r in by_mode["offload"]]
    saved = [r["losses"]["lm loss"] for r in by_mode["save"]]
    loaded = [r["losses"]["lm loss"] for r in by_mode["load"]]
    half = ITERS // 2
    assert len(offloaded) == ITERS and len(saved) == half and len(loaded) == ITERS - half
    assert first_difference(saved, offloaded[:half]) is None
    assert first_difference(loaded, offloaded[half:]) is None, (loaded, offloaded)
    print(
        f"\noffload API: saved after offload/reload at {half}, loaded and offloaded again; "
        f"iterations {half + 1}-{ITERS} bit-identical (loss {loaded[-1]!r})"
    )
