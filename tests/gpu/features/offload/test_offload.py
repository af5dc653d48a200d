"""megatron.patchset.features.offload on GPUs, with the model and optimizer megatron's training
set-up builds (DDP with the distributed optimizer, and Megatron-FSDP; EP=2 over two GPUs): after 10
iterations the parameters, gradients and optimizer state are offloaded (device memory drops by what
was released) and reloaded, and the next 10 iterations are bit-identical to a run that never
offloaded. Negative control: moving the parameters naively (``param.data = param.data.cpu()`` and
back) leaves the
optimizer updating megatron's buffer while the module keeps its stale copy."""

import os

import pytest

from tests.gpu.conftest import ROOT, first_difference, launch, tiny_argv

pytestmark = pytest.mark.gpu
HARNESS = os.path.join(ROOT, "tests", "gpu", "harness", "offload.py")
ITERS = 20


def by_mode(run):
    modes: dict = {}
    for record in run.records:
        if "mode" in record:
            modes.setdefault(record["mode"], []).append(record)
    return modes


def losses(records):
    return [r["losses"]["lm loss"] for r in records if "iteration" in r]


def event(records, name):
    return next(r for r in records if r.get("event") == name)


@pytest.mark.gpus(2)
def test_offload_reload_continues_bit_identically(tmp_path):
    argv = tiny_argv(
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--train-iters",
        str(ITERS),
        "--deterministic-mode",
    )
    run = launch(
        tmp_path,
        "offload_ddp_ep2",
        2,
        argv,
        entry=[HARNESS],
        env={"OFFLOAD_MODES": "plain,offload,naive"},
    )
    modes = by_mode(run)
    plain, offload, naive = losses(modes["plain"]), losses(modes["offload"]), losses(modes["naive"])
    assert len(plain) == len(offload) == len(naive) == ITERS

    # Offload released the parameter buffer, the gradient buffer and the optimizer state.
    mem = event(modes["offload"], "offload")
    dropped = mem["allocated_before"] - mem["allocated_offloaded"]
    assert mem["released_bytes"] > mem["param_bytes"] > 0
    assert dropped >= 0.99 * mem["released_bytes"], mem
    assert (
        abs(mem["allocated_reloaded"] - mem["allocated_before"]) <= 0.01 * mem["allocated_before"]
    ), mem

    # ... and training continued exactly as without it.
    assert first_difference(plain, offload) is None, first_difference(plain, offload)
    plain_norms = [r["grad_norm"] for r in modes["plain"] if "iteration" in r]
    offload_norms = [r["grad_norm"] for r in modes["offload"] if "iteration" in r]
    assert first_difference(plain_norms, offload_norms) is None

    # Negative control: after the naive move the optimizer's updates no longer reach the module.
    moved = event(modes["naive"], "naive")
    assert moved["params"] > 0 and moved["params_changed"] == 0, moved
    assert naive[: ITERS // 2] == plain[: ITERS // 2]
    print(
        f"\noffload: {mem['released_bytes'] / 2**20:.1f} MiB released "
        f"({mem['kept_bytes'] / 2**20:.1f} MiB copied to host), memory_allocated "
        f"{mem['allocated_before'] / 2**20:.1f} -> {mem['allocated_offloaded'] / 2**20:.1f} -> "
        f"{mem['allocated_reloaded'] / 2**20:.1f} MiB; losses identical for {ITERS} iterations "
        f"(last {offload[-1]!r}); naive move: {moved['params_changed']}/{moved['params']} "
        "parameters changed by the next step"
    )


@pytest.mark.gpus(2)
def test_offload_reload_megatron_fsdp(tmp_path):
    """The same through Megatron-FSDP's buffers (parameters, gradients and optimizer state
    sharded)."""
    argv = tiny_argv(
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--ckpt-format",
        "fsdp_dtensor",
        "--train-iters",
        str(ITERS),
        "--deterministic-mode",
    )
    run = launch(
        tmp_path,
        "offload_fsdp_ep2",
        2,
        argv,
        entry=[HARNESS],
        env={"OFFLOAD_MODES": "plain,offload", "CUDA_DEVICE_MAX_CONNECTIONS": "8"},
    )  # FSDP refuses 1
    modes = by_mode(run)
    plain, offload = losses(modes["plain"]), losses(modes["offload"])
    assert len(plain) == len(offload) == ITERS
    mem = event(modes["offload"], "offload")
    assert mem["released_bytes"] > 0
    assert mem["allocated_before"] - mem["allocated_offloaded"] >= 0.99 * mem["released_bytes"], mem
    assert (
        abs(mem["allocated_reloaded"] - mem["allocated_before"]) <= 0.01 * mem["allocated_before"]
    ), mem
    assert first_difference(plain, offload) is None, first_difference(plain, offload)
    print(
        f"\nMegatron-FSDP offload: {mem['released_bytes'] / 2**20:.1f} MiB released, "
        f"memory_allocated {mem['allocated_before'] / 2**20:.1f} -> "
        f"{mem['allocated_offloaded'] / 2**20:.1f} -> {mem['allocated_reloaded'] / 2**20:.1f} MiB; "
        f"losses identical for {ITERS} iterations"
    )
