"""``--adam-impl torch|triton`` under megatron's distributed optimizer, on the CPU: megatron's
DistributedDataParallel and DistributedOptimizer (gloo, 2 and 4 data-parallel ranks) around the
tiny MoE GPT, against megatron's own Adam (torch's fused step, and the one-kernel step under
Triton's interpreter); a resume from megatron's distributed checkpoint at the same size (2 and 4
ranks), with and without the patches that carry the step; a checkpoint of 2 ranks loaded at 4
and one of 4 loaded at 2; the bf16 shards the one-kernel step writes (Triton's interpreter); its
bf16 moments (``--adam-moments-dtype bf16``) through megatron's distributed checkpoint, resumed
at 2 ranks and loaded at 4; and megatron's ``--overlap-grad-reduce --overlap-param-gather``
around both steps, with a resume. The worker is tests/unit/support/cpu_distributed_optimizer.py;
each spawn runs several phases in one process group."""

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

# Its module fixtures are built once: every test of the module runs in one xdist worker.
pytestmark = pytest.mark.xdist_group("torch-adam-distributed")

N, K = 6, 3  # iterations of a run; the iteration a checkpoint is saved at
STEP_PATCHES = ["torch_adam.dist_opt_save_step", "torch_adam.dist_opt_load_step"]
TRITON = importlib.util.find_spec("triton") is not None
# Losses and gradient norms of megatron's Adam and torch's fused one: identical at 2 ranks, within
# 1e-7 (relative) at 4; parameters and moments after a step as the other torch_adam tests compare
# them.
LOSS_RTOL = 1e-6
STATE_TOL = dict(rtol=2e-6, atol=1e-7)
# The one-kernel step under Triton's interpreter in programs of 16384 elements: a few dozen
# programs per rank step the tiny model (the kernel's block of 512 takes several hundred, several
# seconds a step). The update is element-wise and masked at each tensor's end, the same for any
# block; test_triton_step.py steps tensors across the kernel's own block boundary.
INTERPRETED = dict(interpret=True, block=16384)
# --adam-impl triton --adam-moments-dtype bf16 with bf16 parameters
MOMENTS_BF16 = dict(impl="triton", bf16=True, moments="bf16", **INTERPRETED)
SHARDINGS = ["dp_reshardable", "fully_reshardable"]


def moments_bf16_checkpoint(checkpoints, sharding):
    return str(checkpoints / f"moments_bf16_{sharding}")


class Run:
    """The records of one spawn: ``run[phase]`` is the phase's record on each rank."""

    def __init__(self, out, records):
        self.out, self.records = out, records

    def __getitem__(self, phase):
        return self.records[phase]

    def state(self, phase):
        """{name: {param, exp_avg, exp_avg_sq}}, full tensors in the dtypes the optimizer keeps
        them in, as the phase dumped them."""
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


def torch_save(name, save, **extra):
    """A phase of --adam-impl torch that trains K iterations and saves: ``save`` is
    {sharding: folder}."""
    saved = {sharding: str(folder) for sharding, folder in save.items()}
    return dict(name=name, impl="torch", stop=K, save=saved, **extra)


def torch_load(name, folder, sharding, stop=N, **extra):
    """A phase of --adam-impl torch that loads the checkpoint in ``folder`` (saved with
    ``sharding``) and trains iterations K+1..``stop``."""
    return dict(name=name, impl="torch", start=K, stop=stop, load=[str(folder), sharding], **extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, checkpoints):
    """Two ranks: megatron's Adam and --adam-impl torch over N iterations (the state dumped after
    the first); K iterations saved in two formats, with and without the step patches; one bf16
    step of megatron's Adam, torch and triton (under Triton's interpreter); triton with bf16
    moments over N iterations (the state dumped after the last), and over K saved in both
    formats."""
    bf16 = [
        dict(name="bf16_megatron", impl="megatron", stop=1, state_after=1, bf16=True),
        dict(name="bf16_torch", impl="torch", stop=1, state_after=1, bf16=True),
    ]
    if TRITON:
        bf16.append(
            dict(name="bf16_triton", impl="triton", stop=1, state_after=1, bf16=True, **INTERPRETED)
        )
        bf16 += [
            dict(name="moments_bf16", stop=N, state_after=N, **MOMENTS_BF16),
            dict(name="triton", impl="triton", stop=N, **INTERPRETED),
            dict(name="moments_bf16_overlap", stop=N, overlap=True, **MOMENTS_BF16),
            dict(
                name="moments_bf16_save",
                stop=K,
                state_after=K,
                save={s: moments_bf16_checkpoint(checkpoints, s) for s in SHARDINGS},
                **MOMENTS_BF16,
            ),
        ]
    return spawn(
        tmp_path_factory.mktemp("dp2"),
        2,
        [
            dict(name="megatron", impl="megatron", stop=N, state_after=1),
            dict(name="torch", impl="torch", stop=N, state_after=1),
            torch_save(
                "save",
                {s: checkpoints / s for s in SHARDINGS},
                state_after=K,
            ),
            dict(name="overlap", impl="torch", stop=N, overlap=True),
            torch_save("overlap_save", {"dp_reshardable": checkpoints / "overlap"}, overlap=True),
            torch_save(
                "overlap_stale_save",
                {"dp_reshardable": checkpoints / "overlap_stale"},
                overlap=True,
                stale_save=True,
            ),
            torch_save(
                "save_without_step",
                {"dp_reshardable": checkpoints / "without_step"},
                revert=STEP_PATCHES,
            ),
            *bf16,
        ],
    )


@pytest.fixture(scope="module")
def dp2_resumed(tmp_path_factory, dp2, checkpoints):
    """Two fresh ranks: each of dp2's checkpoints loaded, iterations K+1..N (with bf16 moments:
    the dp_reshardable one, the state dumped after the last)."""

    def resume(name, folder, sharding="dp_reshardable", **extra):
        return torch_load(name, checkpoints / folder, sharding, **extra)

    return spawn(
        tmp_path_factory.mktemp("dp2_resumed"),
        2,
        [
            resume("dp_reshardable", "dp_reshardable"),
            resume("fully_reshardable", "fully_reshardable", "fully_reshardable"),
            resume("without_step", "without_step"),
            resume("without_patches", "without_step", revert=STEP_PATCHES),
            resume("overlap", "overlap", overlap=True),
            resume("overlap_stale", "overlap_stale", overlap=True),
            *(
                [
                    dict(
                        name="moments_bf16",
                        start=K,
                        stop=N,
                        state_after=N,
                        load=[
                            moments_bf16_checkpoint(checkpoints, "dp_reshardable"),
                            "dp_reshardable",
                        ],
                        **MOMENTS_BF16,
                    )
                ]
                if TRITON
                else []
            ),
        ],
    )


@pytest.fixture(scope="module")
def dp4(tmp_path_factory, dp2, checkpoints):
    """Four ranks: megatron's Adam and --adam-impl torch over N iterations (EP 1 and 2), dp2's
    fully_reshardable checkpoint loaded, and its checkpoints of bf16 moments loaded (the state
    dumped right after the load; one iteration after the fully_reshardable one)."""
    return spawn(
        tmp_path_factory.mktemp("dp4"),
        4,
        [
            dict(name="megatron", impl="megatron", stop=N, state_after=1),
            dict(name="torch", impl="torch", stop=N, state_after=1),
            dict(name="megatron_ep2", impl="megatron", stop=N, ep=2),
            dict(name="torch_ep2", impl="torch", stop=N, ep=2),
            torch_save("save", {s: checkpoints / f"dp4_{s}" for s in SHARDINGS}, state_after=K),
            *([dict(name="triton", impl="triton", stop=N, **INTERPRETED)] if TRITON else []),
            torch_load(
                "reshard",
                checkpoints / "fully_reshardable",
                "fully_reshardable",
                stop=K + 1,
                state_after=K,
            ),
            *(
                dict(
                    name=f"moments_bf16_{sharding}",
                    start=K,
                    stop=K + (sharding == "fully_reshardable"),
                    state_after=K,
                    load=[moments_bf16_checkpoint(checkpoints, sharding), sharding],
                    **MOMENTS_BF16,
                )
                for sharding in (SHARDINGS if TRITON else [])
            ),
        ],
    )


@pytest.fixture(scope="module")
def dp2_from_dp4(tmp_path_factory, dp4, checkpoints):
    """Two ranks: dp4's fully_reshardable checkpoint loaded (the state dumped right after the
    load), one iteration."""
    return spawn(
        tmp_path_factory.mktemp("dp2_from_dp4"),
        2,
        [
            torch_load(
                "reshard",
                checkpoints / "dp4_fully_reshardable",
                "fully_reshardable",
                stop=K + 1,
                state_after=K,
            )
        ],
    )


@pytest.fixture(scope="module")
def dp4_resumed(tmp_path_factory, dp4, checkpoints):
    """Four fresh ranks: dp4's checkpoint loaded, iterations K+1..N."""
    return spawn(
        tmp_path_factory.mktemp("dp4_resumed"),
        4,
        [torch_load("dp_reshardable", checkpoints / "dp4_dp_reshardable", "dp_reshardable")],
    )


def assert_same_state(ours, reference, **tolerance):
    assert ours.keys() == reference.keys()
    for name in reference:
        assert ours[name].keys() == reference[name].keys() == {"param", "exp_avg", "exp_avg_sq"}
        for key, expected in reference[name].items():
            if tolerance:
                torch.testing.assert_close(ours[name][key], expected, **tolerance)
            else:
                assert ours[name][key].dtype == expected.dtype, (name, key)
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


def assert_continues(resumed, full):
    """A rank that loaded step K continues its run that did not stop: iterations K+1..N with the
    same losses, gradient norms and optimizer steps, to the bit."""
    assert resumed["loaded_steps"] == [[float(K)]]
    assert resumed["iterations"] == list(range(K + 1, N + 1))
    assert resumed["losses"] == full["losses"][K:]
    assert resumed["grad_norms"] == full["grad_norms"][K:]
    assert resumed["steps"] == full["steps"][K:]


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
        assert_continues(resumed, full)


def assert_overlapped(record):
    """megatron's overlap was on: the reduce in several buckets, the parameter all-gather left to
    the forward hooks, which were back after the first iteration."""
    assert record["buckets"] > 1
    assert record["overlap_param_gather"] is True and record["gather_hooks"] > 0


@pytest.mark.slow
def test_the_overlapped_reduce_and_gather_train_as_the_plain_step(dp2):
    """megatron's --overlap-grad-reduce --overlap-param-gather (buckets reduced during the
    backward pass, the parameter all-gather left to the next forward pass's hooks) around
    --adam-impl torch with fp32 parameters: the same losses and gradient norms as without them,
    within the tolerance (the gradient norm sums the shards of more buckets, in another order). A
    parameter shard that the all-gather left stale moves the second loss by about 3e-3 (relative,
    measured with the forward hooks removed)."""
    for plain, overlapped in zip(dp2["torch"], dp2["overlap"], strict=True):
        assert plain["buckets"] == 1 and plain["overlap_param_gather"] is False
        assert_overlapped(overlapped)
        assert overlapped["iterations"] == list(range(1, N + 1))
        assert overlapped["losses"] == pytest.approx(plain["losses"], rel=LOSS_RTOL)
        assert overlapped["grad_norms"] == pytest.approx(plain["grad_norms"], rel=LOSS_RTOL)
        assert overlapped["steps"] == plain["steps"]


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="needs Triton (its interpreter runs the kernel)")
def test_the_overlapped_reduce_and_gather_around_the_one_kernel_step(dp2):
    """The same overlap around --adam-impl triton with bf16 parameters and bf16 moments (under
    Triton's interpreter): the kernel writes every rank's bf16 shards, which the deferred
    all-gather then spreads; the first three losses are the plain step's within the tolerance,
    and the rounding of the bf16 moments carries the gradient norm's difference to a few 1e-5 of
    the loss from the fourth (a stale shard: 3e-3 at the second)."""
    for plain, overlapped in zip(dp2["moments_bf16"], dp2["moments_bf16_overlap"], strict=True):
        assert_overlapped(overlapped)
        assert overlapped["kernel"] and all(overlapped["kernel"])
        assert overlapped["bf16_shards"] is True
        assert overlapped["losses"] == pytest.approx(plain["losses"], rel=1e-4)
        assert overlapped["losses"][:3] == pytest.approx(plain["losses"][:3], rel=LOSS_RTOL)


@pytest.mark.slow
def test_an_overlapped_run_resumes_bit_identically(dp2, dp2_resumed):
    """The overlapped run (--adam-impl torch, fp32) saved at K in the dp_reshardable format, its
    parameters gathered first as megatron's save does, and loaded by fresh processes that run as
    megatron's train() does (the first iteration without the all-gather's hooks, on the loaded
    parameters): iterations K+1..N are those of the overlapped run that did not stop, to the bit.
    Saved without that gather, the checkpoint holds another rank's shard as the last step left it,
    and a first resumed loss differs."""
    for full, saved, resumed in zip(
        dp2["overlap"], dp2["overlap_save"], dp2_resumed["overlap"], strict=True
    ):
        assert_overlapped(resumed)
        assert saved["losses"] == full["losses"][:K]
        assert_continues(resumed, full)
    # A rank whose own shard the loaded main parameters overwrite sees the run's weights; the
    # rank that saved the model's parameters keeps the other shard as its last step left it.
    stale = dp2_resumed["overlap_stale"]
    assert all(rank["iterations"] == list(range(K + 1, N + 1)) for rank in stale)
    assert [rank["losses"][0] for rank in stale] != [rank["losses"][K] for rank in dp2["overlap"]]


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="needs Triton (its interpreter runs the kernel)")
@pytest.mark.parametrize("size", ["dp2", "dp4"])
def test_the_triton_impl_trains_as_megatrons_adam(request, size):
    """--adam-impl triton (the one-kernel step, under Triton's interpreter) against megatron's
    Adam over N iterations at 2 and 4 ranks: the same losses and gradient norms within the
    tolerance of the torch impl, with the kernel stepping every rank's shard."""
    run = request.getfixturevalue(size)
    for ref, own in zip(run["megatron"], run["triton"], strict=True):
        assert "torch_adam.triton_step" in own["applied"]
        assert own["kernel"] and all(own["kernel"])
        assert own["iterations"] == ref["iterations"] == list(range(1, N + 1))
        assert own["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
        assert own["grad_norms"] == pytest.approx(ref["grad_norms"], rel=LOSS_RTOL)
        assert own["steps"][-1] == [[float(N)]] * len(own["inner"])


@pytest.mark.slow
def test_a_resume_at_4_ranks_continues_bit_identically(dp4, dp4_resumed):
    """K iterations at 4 data-parallel ranks, megatron's distributed checkpoint, 4 fresh ranks
    that load it: iterations K+1..N are those of the run that did not stop, to the bit."""
    for full, saved, resumed in zip(
        dp4["torch"], dp4["save"], dp4_resumed["dp_reshardable"], strict=True
    ):
        assert saved["losses"] == full["losses"][:K]
        assert_continues(resumed, full)


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
def test_a_checkpoint_of_4_ranks_loads_at_2_with_the_same_state(dp4, dp2_from_dp4):
    """The other direction: the fully_reshardable checkpoint saved at 4 data-parallel ranks,
    loaded at 2, gives to the bit the fp32 main parameters and moments the 4 ranks held, every
    rank holds the step, and the next step runs."""
    assert_same_state(dp2_from_dp4.state("reshard"), dp4.state("save"))
    for rank in dp2_from_dp4["reshard"]:
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


BF16_MOMENTS = {"exp_avg": ["torch.bfloat16"], "exp_avg_sq": ["torch.bfloat16"]}


def stored_moment_dtypes(folder):
    """{exp_avg, exp_avg_sq: the dtypes megatron's distributed checkpoint in ``folder`` stores
    that moment in}, from the metadata of the torch.distributed.checkpoint files that
    ``--ckpt-format torch_dist`` writes."""
    from torch.distributed.checkpoint import FileSystemReader

    dtypes = {"exp_avg": set(), "exp_avg_sq": set()}
    for key, stored in FileSystemReader(folder).read_metadata().state_dict_metadata.items():
        for moment, found in dtypes.items():
            if moment in key.split("."):
                found.add(stored.properties.dtype)
    return dtypes


def assert_bf16_moments(state):
    """Every dumped moment is bf16, every main parameter fp32."""
    for tensors in state.values():
        assert tensors["param"].dtype == torch.float32
        assert tensors["exp_avg"].dtype == tensors["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="needs triton")
def test_bf16_moments_resume_from_the_distributed_checkpoint_bit_identically(dp2, dp2_resumed):
    """--adam-impl triton --adam-moments-dtype bf16 (bf16 parameters, Triton's interpreter), K
    iterations saved in megatron's dp_reshardable checkpoint at 2 ranks, fresh processes at 2
    that load it: the moments load as bf16, iterations K+1..N have the losses and gradient norms
    of the run that did not stop, and the main parameters and both moments after iteration N
    are its own, to the bit and in the same dtypes."""
    full, save = dp2["moments_bf16"], dp2["moments_bf16_save"]
    for full_rank, save_rank, resumed in zip(full, save, dp2_resumed["moments_bf16"], strict=True):
        for record in (full_rank, save_rank, resumed):
            assert record["inner"] == [["TritonAdamW", True]] and record["kernel"] == [True]
            assert record["copies_taken"] == [True] * len(record["iterations"])
            assert record["dtypes"] == [BF16_MOMENTS]
        assert save_rank["losses"] == full_rank["losses"][:K]
        assert save_rank["grad_norms"] == full_rank["grad_norms"][:K]
        groups = resumed["checkpoint_group_steps"]
        assert groups == [float(K)] * len(groups)
        assert resumed["loaded_dtypes"] == [BF16_MOMENTS]
        assert_continues(resumed, full_rank)
    state = dp2_resumed.state("moments_bf16")
    assert_bf16_moments(state)
    assert_same_state(state, dp2.state("moments_bf16"))


@pytest.mark.slow
@pytest.mark.skipif(not TRITON, reason="needs triton")
@pytest.mark.parametrize(
    "sharding, stored", [("dp_reshardable", torch.bfloat16), ("fully_reshardable", torch.float32)]
)
def test_bf16_moments_of_2_ranks_load_at_4_in_bf16_with_the_same_state(
    dp2, dp4, checkpoints, sharding, stored
):
    """The checkpoints of bf16 moments saved at 2 data-parallel ranks, loaded at 4: every rank's
    moments are bf16 right after the load, and the main parameters and both moments gathered over
    the 4 ranks are, to the bit, those the 2 ranks held when they saved. The dp_reshardable
    checkpoint stores the moments as the optimizer keeps them (bf16), the fully_reshardable one
    as megatron gathers them (fp32, the same values). After the fully_reshardable load the next
    step runs in the kernel and keeps the moments in bf16."""
    expected = {moment: {stored} for moment in ("exp_avg", "exp_avg_sq")}
    assert stored_moment_dtypes(moments_bf16_checkpoint(checkpoints, sharding)) == expected
    name = f"moments_bf16_{sharding}"
    state = dp4.state(name)
    assert_bf16_moments(state)
    assert_same_state(state, dp2.state("moments_bf16_save"))
    for rank in dp4[name]:
        groups = rank["checkpoint_group_steps"]
        assert groups == [float(K)] * len(groups)
        assert rank["loaded_steps"] == [[float(K)]]
        assert rank["loaded_dtypes"] == [BF16_MOMENTS]
        if sharding == "fully_reshardable":
            assert rank["kernel"] == [True] and rank["steps"] == [[[float(K + 1)]]]
            assert rank["dtypes"] == [BF16_MOMENTS]
            assert math.isfinite(rank["losses"][0])


def test_the_one_kernel_adam_loads_its_moments_in_their_dtype():
    """torch's load_state_dict casts every floating state tensor but the step to its parameter's
    dtype; the one-kernel Adam with bf16 moments keeps them bf16 through a state_dict round trip
    (the same values), and rounds fp32 moments of a checkpoint to nearest even as they load."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
    saved = build_adam(params, lr=1e-3, impl="triton", moments_dtype="bf16")
    for p in params:
        saved.state[p].update(
            step=torch.tensor(3.0),
            exp_avg=torch.randn(8).to(torch.bfloat16),
            exp_avg_sq=torch.rand(8).to(torch.bfloat16),
        )
    loaded = build_adam(params, lr=1e-3, impl="triton", moments_dtype="bf16")
    loaded.load_state_dict(saved.state_dict())
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert loaded.state[p][key].dtype == torch.bfloat16
            assert torch.equal(loaded.state[p][key], saved.state[p][key])
        assert loaded.state[p]["step"].dtype == torch.float32
    fp32 = saved.state_dict()
    for state in fp32["state"].values():
        state["exp_avg"] = state["exp_avg"].float() + 1e-4  # between two bf16 values
    loaded.load_state_dict(fp32)
    for index, p in enumerate(params):
        exact = fp32["state"][index]["exp_avg"]
        expected = exact.to(torch.bfloat16)
        assert not torch.equal(expected.float(), exact)
        assert loaded.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(loaded.state[p]["exp_avg"], expected)


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
