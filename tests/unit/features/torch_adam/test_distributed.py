"""``--adam-impl torch|triton`` under megatron's distributed optimizer, on the CPU: megatron's
DistributedDataParallel and DistributedOptimizer (gloo, 2 and 4 data-parallel ranks) around the
tiny MoE GPT, against megatron's own Adam; a resume from megatron's distributed checkpoint at the
same size, with and without the patches that carry the step; a checkpoint of 2 ranks loaded at
4; and the bf16 shards the one-kernel step writes (Triton's interpreter). The worker is
tests/unit/support/cpu_distributed_optimizer.py; each spawn runs several phases in one process
group."""

import importlib.util
import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from megatron.patchset.features.torch_adam import clipping
from megatron.patchset.features.torch_adam.optimizer import build_adam
from tests.unit.support import cpu_distributed_optimizer as worker
from tests.unit.support import cpu_train

N, K = 6, 3  # iterations of a run; the iteration a checkpoint is saved at
STEP_PATCHES = ["torch_adam.dist_opt_save_step", "torch_adam.dist_opt_load_step"]
TRITON = importlib.util.find_spec("triton") is not None
# Losses and gradient norms of megatron's Adam and torch's fused one: identical at 2 ranks, within
# 1e-7 (relative) at 4; parameters and moments after a step as the other torch_adam tests compare
# them.
LOSS_RTOL = 1e-6
STATE_TOL = dict(rtol=2e-6, atol=1e-7)


class Run:
    """The records of one spawn: ``run[phase]`` is the phase's record on each rank."""

    def __init__(self, out, records):
        self.out, self.records = out, records

    def __getitem__(self, phase):
        return self.records[phase]

    def state(self, phase):
        """{name: {param, exp_avg, exp_avg_sq}}, full fp32 tensors, as the phase dumped them."""
        return torch.load(f"{self.out}.{phase}.pt")


def spawn(folder, world_size, phases):
    folder.mkdir(parents=True, exist_ok=True)
    out = str(folder / "run")
    mp.spawn(
        worker.run,
        args=(world_size, cpu_train.free_port(), out, phases),
        nprocs=world_size,
        join=True,
    )
    ranks = [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]
    for rank in ranks:
        for record in rank.values():
            assert "error" not in record or record["name"].endswith("without_patches"), record.get(
                "traceback"
            )
    return Run(out, {name: [rank[name] for rank in ranks] for name in ranks[0]})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, checkpoints):
    """Two ranks: megatron's Adam and --adam-impl torch over N iterations (the state dumped after
    the first); K iterations saved in two formats, with and without the step patches; one bf16
    step of megatron's Adam, torch and triton (under Triton's interpreter)."""
    bf16 = [
        dict(name="bf16_megatron", impl="megatron", stop=1, state_after=1, bf16=True),
        dict(name="bf16_torch", impl="torch", stop=1, state_after=1, bf16=True),
    ]
    if TRITON:
        bf16.append(
            dict(
                name="bf16_triton", impl="triton", stop=1, state_after=1, bf16=True, interpret=True
            )
        )
    return spawn(
        tmp_path_factory.mktemp("dp2"),
        2,
        [
            dict(name="megatron", impl="megatron", stop=N, state_after=1),
            dict(name="torch", impl="torch", stop=N, state_after=1),
            dict(
                name="save",
                impl="torch",
                stop=K,
                state_after=K,
                save={
                    "dp_reshardable": str(checkpoints / "dp_reshardable"),
                    "fully_reshardable": str(checkpoints / "fully_reshardable"),
                },
            ),
            dict(
                name="save_without_step",
                impl="torch",
                stop=K,
                revert=STEP_PATCHES,
                save={"dp_reshardable": str(checkpoints / "without_step")},
            ),
            *bf16,
        ],
    )


@pytest.fixture(scope="module")
def dp2_resumed(tmp_path_factory, dp2, checkpoints):
    """Two fresh ranks: each of dp2's checkpoints loaded, iterations K+1..N."""

    def resume(name, folder, sharding="dp_reshardable", **extra):
        return dict(
            name=name,
            impl="torch",
            start=K,
            stop=N,
            load=[str(checkpoints / folder), sharding],
            **extra,
        )

    return spawn(
        tmp_path_factory.mktemp("dp2_resumed"),
        2,
        [
            resume("dp_reshardable", "dp_reshardable"),
            resume("fully_reshardable", "fully_reshardable", "fully_reshardable"),
            resume("without_step", "without_step"),
            resume("without_patches", "without_step", revert=STEP_PATCHES),
        ],
    )


@pytest.fixture(scope="module")
def dp4(tmp_path_factory, dp2, checkpoints):
    """Four ranks: megatron's Adam and --adam-impl torch over N iterations (EP 1 and 2), and dp2's
    fully_reshardable checkpoint loaded."""
    return spawn(
        tmp_path_factory.mktemp("dp4"),
        4,
        [
            dict(name="megatron", impl="megatron", stop=N, state_after=1),
            dict(name="torch", impl="torch", stop=N, state_after=1),
            dict(name="megatron_ep2", impl="megatron", stop=N, ep=2),
            dict(name="torch_ep2", impl="torch", stop=N, ep=2),
            dict(
                name="reshard",
                impl="torch",
                start=K,
                stop=K + 1,
                state_after=K,
                load=[str(checkpoints / "fully_reshardable"), "fully_reshardable"],
            ),
        ],
    )


def assert_same_state(ours, reference, **tolerance):
    assert ours.keys() == reference.keys()
    for name in reference:
        assert ours[name].keys() == reference[name].keys() == {"param", "exp_avg", "exp_avg_sq"}
        for key, expected in reference[name].items():
            if tolerance:
                torch.testing.assert_close(ours[name][key], expected, **tolerance)
            else:
                assert torch.equal(ours[name][key], expected), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "size, reference, ours",
    [
        ("dp2", "megatron", "torch"),
        ("dp4", "megatron", "torch"),
        ("dp4", "megatron_ep2", "torch_ep2"),
    ],
)
def test_torch_impl_trains_as_megatrons_adam(request, size, reference, ours):
    """Same seed and data: the losses and gradient norms of every iteration, and (EP 1) the
    fp32 main parameters and moments after the first, are megatron's Adam's within the
    tolerance; the clip went into torch's fused step (its grad_scale) at every step. (Later
    states differ by up to a few 1e-7 where Adam's first moment nearly cancels: the two round the
    clipped gradients differently, megatron multiplying by the clip factor and torch dividing by
    its inverse.)"""
    run = request.getfixturevalue(size)
    for ref, own in zip(run[reference], run[ours], strict=True):
        assert ref["inner"] == [["AdamW", False]] * len(ref["inner"])  # torch's for-loop AdamW
        assert own["inner"] == [["AdamW", True]] * len(own["inner"])
        assert len(own["inner"]) == (2 if ours.endswith("ep2") else 1)  # dense and expert
        assert {"torch_adam.fused_step", "torch_adam.clip"} <= set(own["applied"])
        assert own["iterations"] == ref["iterations"] == list(range(1, N + 1))
        assert own["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
        assert own["grad_norms"] == pytest.approx(ref["grad_norms"], rel=LOSS_RTOL)
        assert own["steps"][-1] == [[float(N)]] * len(own["inner"])
        # the norms are above --clip-grad: megatron scales the gradients, torch divides by the
        # clip scale as it reads them
        assert all(norm > float(worker.CLIP_GRAD) for norm in ref["grad_norms"])
        assert ref["grad_scales"] == [None] * N * len(ref["inner"])
        assert all(scale > 1.0 for scale in own["grad_scales"])
        assert all(math.isfinite(x) for x in own["losses"])
        assert own["losses"][-1] < own["losses"][0]
    if not ours.endswith("ep2"):
        assert_same_state(run.state(ours), run.state(reference), **STATE_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_a_resume_at_the_same_size_continues_bit_identically(dp2, dp2_resumed, sharding):
    """K iterations, megatron's distributed checkpoint (the sharding megatron saves by default
    and the fully reshardable one), fresh processes that load it: iterations K+1..N have the
    losses and gradient norms of the run that did not stop, to the bit, from step K."""
    for full, resumed in zip(dp2["torch"], dp2_resumed[sharding], strict=True):
        assert resumed["checkpoint_group_steps"] == [float(K)] * len(
            resumed["checkpoint_group_steps"]
        )
        assert resumed["loaded_steps"] == [[float(K)]]
        assert resumed["iterations"] == list(range(K + 1, N + 1))
        assert resumed["losses"] == full["losses"][K:]
        assert resumed["grad_norms"] == full["grad_norms"][K:]
        assert resumed["steps"] == full["steps"][K:]


@pytest.mark.slow
def test_without_the_step_patches_the_checkpoint_loses_the_step(dp2, dp2_resumed):
    """With TransformerEngine installed megatron saves the step from the parameter groups, where
    torch's Adam keeps none: a checkpoint saved without torch_adam.dist_opt_save_step has no
    step, and the resumed Adam restarts its bias correction at step 1 (the loss drifts from the
    second resumed iteration). Without torch_adam.dist_opt_load_step the load itself fails:
    torch's Adam finds no step in the moments megatron loads."""
    for saved, unsaved in zip(dp2["save"], dp2["save_without_step"], strict=True):
        assert set(STEP_PATCHES) <= set(saved["applied"])
        assert not set(STEP_PATCHES) & set(unsaved["applied"])
        assert unsaved["losses"] == saved["losses"]
    for full, restarted, failed in zip(
        dp2["torch"], dp2_resumed["without_step"], dp2_resumed["without_patches"], strict=True
    ):
        assert set(restarted["checkpoint_group_steps"]) == {None}
        assert restarted["loaded_steps"] == [[0.0]]
        assert restarted["steps"] == [[[float(s)]] for s in range(1, N - K + 1)]
        assert restarted["losses"][0] == full["losses"][K]  # the weights were loaded
        assert all(a != b for a, b in zip(restarted["losses"][1:], full["losses"][K + 1 :]))
        assert failed["error"].startswith("KeyError: 'step'")
        assert not set(STEP_PATCHES) & set(failed["applied"])


@pytest.mark.slow
def test_a_checkpoint_of_2_ranks_loads_at_4_with_the_same_state(dp2, dp4):
    """The fully_reshardable checkpoint saved at 2 data-parallel ranks, loaded at 4: the fp32
    main parameters and both moments gathered over the 4 ranks are, to the bit, those the 2
    ranks held when they saved, every rank holds the step, and the next step runs."""
    assert_same_state(dp4.state("reshard"), dp2.state("save"))
    for rank in dp4["reshard"]:
        assert rank["checkpoint_group_steps"] == [float(K)] * len(rank["checkpoint_group_steps"])
        assert rank["loaded_steps"] == [[float(K)]]
        assert rank["steps"] == [[[float(K + 1)]]]
        assert math.isfinite(rank["losses"][0])


@pytest.mark.slow
def test_bf16_torch_impl_copies_the_shards_with_one_foreach_copy(dp2):
    """bf16 model parameters, fp32 main shards: after a step every bf16 shard of DDP's parameter
    buffer is its main shard rounded to bf16, written by one _foreach_copy_ (megatron's own Adam
    copies parameter by parameter), and the main parameters and moments are megatron's."""
    for ref, own in zip(dp2["bf16_megatron"], dp2["bf16_torch"], strict=True):
        assert "torch_adam.dist_opt_param_copy" in own["applied"]
        assert own["bf16_shards"] is ref["bf16_shards"] is True and own["bf16_shard_count"] > 0
        assert own["foreach_copies"] == 1 and ref["foreach_copies"] == 0
        assert own["losses"][0] == ref["losses"][0]
    assert_same_state(dp2.state("bf16_torch"), dp2.state("bf16_megatron"), **STATE_TOL)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="needs triton")
def test_the_triton_kernel_writes_the_bf16_shards(dp2):
    """--adam-impl triton under Triton's interpreter: the kernel stepped (no fallback), each
    rank's bf16 shards equal its fp32 main shards rounded to bf16 after the step, megatron's copy
    found them written and copied nothing, and the main parameters and moments are
    --adam-impl torch's."""
    for ref, own in zip(dp2["bf16_torch"], dp2["bf16_triton"], strict=True):
        assert own["inner"] == [["TritonAdamW", True]] and own["kernel"] == [True]
        assert "torch_adam.dist_opt_links" in own["applied"]
        assert own["bf16_shards"] is True and own["bf16_shard_count"] == ref["bf16_shard_count"]
        assert own["copies_taken"] == [True] and own["foreach_copies"] == 0
        assert own["losses"][0] == ref["losses"][0]
    assert_same_state(dp2.state("bf16_triton"), dp2.state("bf16_torch"), **STATE_TOL)


def test_the_clip_scale_reaches_an_adam_whose_first_group_is_empty_on_this_rank():
    """megatron's distributed optimizer keeps a parameter group that holds nothing on a rank:
    the clip scale is made on the device of the parameters the optimizer does hold."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for param in params:
        param.grad = torch.full((4,), 2.0)
    optimizer = build_adam([{"params": []}, {"params": params}], lr=1e-3)
    clip = clipping.clip_into_adam(lambda *a, **k: pytest.fail("megatron's clip was called"))
    clip(params, 1.0, torch.tensor(4.0))
    assert optimizer.grad_scale.item() == pytest.approx(4.0)
