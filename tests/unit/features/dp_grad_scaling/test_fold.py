"""``--ddp-scale-grads-in-loss`` on the CPU: megatron's DistributedDataParallel and distributed
optimizer around the tiny MoE GPT (gloo, 2 and 4 data-parallel ranks, EP 1 and 2), each backward
pass seeded from ``optimizer.scale_loss`` as megatron's training loop seeds it; at DP 2 also with
bf16 parameters (fp32 main gradients). With the fold, DDP's buckets scale by 1 and the loss
gradient by 1/DP: losses, gradient norms and the optimizer's state after the run are megatron's
to the bit. The worker is
tests/unit/support/cpu_distributed_optimizer.py."""

import pytest
import torch

from megatron.patchset.core import rules
from megatron.patchset.features.dp_grad_scaling import patches
from tests.unit.features.torch_adam.test_distributed import spawn

N = 4
LOSS_ONLY = ["dp_grad_scaling.scaled_loss_gradient"]


def phases(ep, bf16=False):
    tag = (f"_ep{ep}" if ep > 1 else "") + ("_bf16" if bf16 else "")
    common = dict(impl="megatron", stop=N, state_after=N, scale_loss=True, ep=ep, bf16=bf16)
    return [
        dict(name=f"megatron{tag}", **common),
        dict(name=f"fold{tag}", fold=True, **common),
        # the buffers unscaled, the loss gradient not: what the fold would be without its half
        dict(name=f"buffers_only{tag}", fold=True, revert=LOSS_ONLY, **common),
    ]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return spawn(tmp_path_factory.mktemp("fold_dp2"), 2, phases(1) + phases(1, bf16=True))


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    return spawn(tmp_path_factory.mktemp("fold_dp4"), 4, phases(1) + phases(2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "size, dp, ep, bf16",
    [("dp2", 2, 1, False), ("dp2", 2, 1, True), ("dp4", 4, 1, False), ("dp4", 4, 2, False)],
)
def test_fold_trains_as_megatron_to_the_bit(request, size, dp, ep, bf16):
    run = request.getfixturevalue(size)
    tag = (f"_ep{ep}" if ep > 1 else "") + ("_bf16" if bf16 else "")
    for ref, own, half in zip(
        run[f"megatron{tag}"], run[f"fold{tag}"], run[f"buffers_only{tag}"], strict=True
    ):
        assert ref["bucket_factors"] == [1.0 / dp]  # dense and expert buffers alike
        assert own["bucket_factors"] == half["bucket_factors"] == [1.0]
        assert {"dp_grad_scaling.unscaled_buffers", "dp_grad_scaling.scaled_loss_gradient"} <= set(
            own["applied"]
        )
        assert len(own["inner"]) == (2 if ep > 1 else 1)  # dense and expert optimizers
        assert own["iterations"] == ref["iterations"] == list(range(1, N + 1))
        assert own["losses"] == ref["losses"]
        assert own["grad_norms"] == ref["grad_norms"]
        # without the loss half the gradients are DP times too large: the first norm shows it
        assert half["losses"][0] == ref["losses"][0]
        assert half["grad_norms"][0] == pytest.approx(dp * ref["grad_norms"][0], rel=1e-5)
    state, reference = run.state(f"fold{tag}"), run.state(f"megatron{tag}")
    assert state.keys() == reference.keys()
    for name in reference:
        for key, expected in reference[name].items():
            assert torch.equal(state[name][key], expected), (name, key)


class _Buffer:
    """A gradient buffer or bucket of megatron's DDP, as far as the fold reads it."""

    def __init__(self, factor, buckets=0):
        self.gradient_scaling_factor = factor
        self.buckets = [_Buffer(factor) for _ in range(buckets)]


class _DDP:
    def __init__(self, dense, expert):
        self.buffers = [_Buffer(dense, buckets=2)]
        self.expert_parallel_buffers = [_Buffer(expert, buckets=1)]


def test_take_scaling_out_sets_every_bucket_to_one():
    ddp = _DDP(0.125, 0.125)
    assert patches.take_scaling_out(ddp) == 0.125
    assert {b.gradient_scaling_factor for b in patches._buckets(ddp)} == {1.0}
    ddp = _DDP(1 / 3, 1 / 3)  # 3 data-parallel ranks: folded too, within roundings of 1/3
    assert patches.take_scaling_out(ddp) == 1 / 3
    assert {b.gradient_scaling_factor for b in patches._buckets(ddp)} == {1.0}
    assert patches.take_scaling_out(_DDP(1.0, 1.0)) is None


@pytest.mark.parametrize(
    "dense, expert, says",
    [(1.0, 0.125, "different factors")],
)
def test_take_scaling_out_refuses_what_one_factor_cannot_carry(dense, expert, says):
    ddp = _DDP(dense, expert)
    with pytest.raises(Exception, match=says):
        patches.take_scaling_out(ddp)
    assert {b.gradient_scaling_factor for b in patches._buckets(ddp)} == {dense, expert}


def _args(**kw):
    import argparse

    base = dict(
        ddp_scale_grads_in_loss=True,
        use_megatron_fsdp=False,
        use_torch_fsdp2=False,
        ddp_average_in_collective=False,
        calculate_per_token_loss=False,
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(ddp_average_in_collective=True), "no --ddp-average-in-collective"),
        (dict(calculate_per_token_loss=True), "no --calculate-per-token-loss"),
        (dict(use_megatron_fsdp=True), "megatron's DDP"),
    ],
)
def test_rule_names_the_flag_and_the_fix(change, says):
    rule = next(r for r in rules.all_rules() if r.name == "ddp-scale-grads-in-loss-requirements")
    assert rule.check(_args(), None) is None
    message = rule.check(_args(**change), None)
    assert message.startswith("--ddp-scale-grads-in-loss needs: ") and says in message
