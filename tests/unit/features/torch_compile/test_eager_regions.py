"""The eager regions' traceability fixes: the aux-loss gradient op (shape, compiled with inductor)
and the force-balanced random logits drawn as upstream draws them."""

from megatron.patchset.core import registry
from megatron.patchset.features.torch_compile import eager_regions
from tests.unit.conftest import parse, tiny_argv


def test_random_logits_op_draws_what_upstream_draws(monkeypatch):
    """The op's numbers equal upstream RandomSTE's from the same tracker state; the gradient
    passes straight through; the tracker's stream advances as upstream's does."""
    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.moe_utils import RandomSTE

    monkeypatch.setattr(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(
        tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)
    )
    tracker = tp_random.get_cuda_rng_tracker()
    name = tp_random.get_expert_parallel_rng_tracker_name()
    monkeypatch.setattr(tracker, "states_", {name: torch.Generator().manual_seed(7).get_state()})
    op = eager_regions.random_logits_op()
    logits = torch.randn(5, 8, requires_grad=True)
    saved = tracker.states_[name]
    ours = [op(logits), op(logits)]
    tracker.states_[name] = saved
    theirs = [RandomSTE.apply(logits), RandomSTE.apply(logits)]
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], ours[1])  # the stream advanced between the two draws
    ours[0].sum().backward()
    assert torch.equal(logits.grad, torch.ones_like(logits))


def test_random_logits_patch_only_with_force_load_balancing():
    patch = registry.get("torch_compile.random_logits_opaque")
    assert patch.wanted(
        parse(tiny_argv("--compile-transformer-layers", "--moe-router-force-load-balancing"))
    )
    assert not patch.wanted(parse(tiny_argv("--compile-transformer-layers")))
    assert not patch.wanted(parse(tiny_argv("--moe-router-force-load-balancing")))


def test_aux_loss_grad_op_keeps_the_loss_shape():
    """The schedule sets a shape-[1] loss scale; the op's gradient must have the aux loss's own
    shape (its fake tensor says so and inductor asserts it: a 0-d loss got a [1] gradient on the
    first GPU run)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    op = eager_regions.aux_loss_grad_op()
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 0.25)
        scalar = op(torch.tensor(3.0), torch.tensor(1.0))
        assert scalar.shape == () and scalar.item() == 0.25
        vector = op(torch.ones(4), torch.tensor(1.0))
        assert vector.shape == (4,) and torch.equal(vector, torch.full((4,), 0.25))
        torch.library.opcheck(op, (torch.tensor(3.0), torch.tensor(1.0)))
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def test_aux_loss_backward_compiles_with_inductor_on_cpu():
    """Inductor checks the custom op's real output against its fake (the check that failed on
    the first GPU run, reproduced here on the CPU): compiled forward+backward through megatron's
    aux-loss scaler with the schedule's shape-[1] scale gives eager's gradients."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    names = registry.apply_patches([registry.get("torch_compile.aux_loss_backward_opaque")])
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 0.5)

        def step(x, w):
            h = x @ w
            aux = (h.float() ** 2).mean()
            return MoEAuxLossAutoScaler.apply(h, aux).sum()

        x, w = torch.randn(8, 4), torch.randn(4, 4, requires_grad=True)
        torch.compile(step, backend="inductor")(x, w).backward()
        compiled = w.grad.clone()
        w.grad = None
        step(x, w).backward()
        torch.testing.assert_close(compiled, w.grad)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
        registry.revert(names)
