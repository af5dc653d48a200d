"""--adam-impl torch and triton on one GPU.

* megatron-core's bf16 optimizer with the clip applied by the fused kernel and the foreach copy to
  bf16 gives the update of megatron's own passes.
* The kernel: a captured step of torch's capturable fused AdamW, its learning rate changed between
  replays through the tensor the scheduler fills, equals the eager fused AdamW given the same
  learning rates, and TE's FusedAdam within fp32 rounding.
* Training (the full-iteration recipe: experts as grouped GEMMs, token counts on the GPU): with
  torch's Adam the run trains like TE's FusedAdam, and with the optimizer captured too
  (``--optimizer-cuda-graph``) like its eager self; the one-kernel step (``--adam-impl triton``),
  captured, trains like torch's captured fused AdamW.
* The one-kernel step in megatron's bf16 optimizer gives the update of torch's fused AdamW with
  megatron's clip pass and copy, and writes the bf16 parameters as the copy rounds them.
"""

import pytest
import torch

from tests.gpu.conftest import assert_trains_alike, launch_variants, tiny_argv

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

ITERS = 20
RECIPE = (
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--moe-grouped-gemm-impl",
    "torch",
    "--moe-permute-fusion",
    "--moe-expert-splits-on-device",
    "--no-check-for-nan-in-loss-and-grad",
    "--deterministic-mode",
    "--te-rng-tracker",
)
GRAPHS = (
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
    "--optimizer-cuda-graph",
    "--logging-level",
    "20",
)
TORCH = ("--adam-impl", "torch")
TRITON = ("--adam-impl", "triton")
ANNOUNCED = "megatron-patchset: Adam is torch.optim.AdamW (fused"
LOSS_ATOL = 2e-2
GRAD_NORM_RTOL = 5e-2


def _params(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(256, 128), (4096,), (3, 64, 32)]
    ps = [torch.randn(s, generator=gen, device="cuda") * 0.02 for s in shapes]
    grads = [
        [torch.randn(s, generator=gen, device="cuda") * 1e-2 for s in shapes] for _ in range(6)
    ]
    return ps, grads


def test_captured_step_follows_the_learning_rate_and_equals_eager():
    from transformer_engine.pytorch.optimizers import FusedAdam

    from megatron.patchset.features.torch_adam.optimizer import build_adam

    kw = dict(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    lrs = [1e-3, 5e-4, 2e-3, 1e-4, 3e-3, 7e-4]
    start, grads = _params(0)
    captured = [torch.nn.Parameter(p.clone()) for p in start]
    eager = [torch.nn.Parameter(p.clone()) for p in start]
    te = [torch.nn.Parameter(p.clone()) for p in start]
    opt = build_adam(captured, lr=lrs[0], capturable=True, adam_w_mode=True, **kw)
    ref = torch.optim.AdamW(eager, lr=lrs[0], fused=True, **kw)
    te_opt = FusedAdam(te, lr=lrs[0], adam_w_mode=True, **kw)
    lr_tensor = opt.param_groups[0]["lr"]
    assert isinstance(lr_tensor, torch.Tensor) and lr_tensor.is_cuda
    static = [torch.zeros_like(p) for p in captured]
    for p, g in zip(captured, static):
        p.grad = g
    # first step eager (it creates the state), then capture one step and replay it
    for g, s in zip(grads[0], static):
        s.copy_(g)
    opt.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for step, lr in enumerate(lrs):
        for group in ref.param_groups + te_opt.param_groups:
            group["lr"] = lr
        for p, q, g in zip(eager, te, grads[step]):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        te_opt.step()
        if step:
            lr_tensor.fill_(lr)
            for g, s in zip(grads[step], static):
                s.copy_(g)
            graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(captured, eager, te):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    moved = max((a - s).abs().max().item() for a, s in zip(captured, start))
    assert moved > 1e-4  # six steps at these rates move the weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_adam")
    variants = {
        "te_eager": RECIPE,
        "torch_eager": RECIPE + TORCH,
        "torch_graphs": RECIPE + TORCH + GRAPHS,
        "triton_graphs": RECIPE + TRITON + GRAPHS,
    }
    return launch_variants(tmp, variants, ITERS)


def close(ours, reference, label):
    assert_trains_alike(
        ours, reference, label, iters=ITERS, loss_atol=LOSS_ATOL, grad_norm_rtol=GRAD_NORM_RTOL
    )


def test_torch_adam_trains_like_te_fused_adam(runs):
    assert ANNOUNCED in runs["torch_eager"].log_text()
    assert ANNOUNCED not in runs["te_eager"].log_text()
    close(runs["torch_eager"], runs["te_eager"], "torch fused AdamW vs TE FusedAdam, eager")


def test_captured_torch_adam_trains_like_eager(runs):
    log = runs["torch_graphs"].log_text()
    assert "megatron-patchset: Adam is torch.optim.AdamW (fused, capturable)" in log
    assert "Optimizer CUDA graph capture done" in log
    close(
        runs["torch_graphs"],
        runs["torch_eager"],
        "torch AdamW, full-iteration + optimizer graphs vs eager",
    )


def test_the_one_kernel_step_captured_trains_like_torchs_fused_adamw(runs):
    log = runs["triton_graphs"].log_text()
    assert (
        "megatron-patchset: Adam is torch.optim.AdamW (one Triton kernel with the clip and the "
        "bf16 copy, capturable)" in log
    )
    assert "Optimizer CUDA graph capture done" in log
    close(runs["triton_graphs"], runs["torch_graphs"], "one-kernel AdamW vs torch fused, captured")


def _megatron_optimizer(model_params, group):
    from megatron.core.optimizer import Adam, OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for p in model_params:  # not a tensor-parallel duplicate: counts towards the norm
        set_tensor_model_parallel_attributes(p, True, 0, 1)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True, clip_grad=1.0)
    inner = Adam(
        model_params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True
    )
    opt = Float16OptimizerWithFloat16Params(inner, config, None, lambda *a, **k: None)
    opt.grad_stats_parallel_group = group
    return opt


def _train_megatrons_optimizer(patches, group, monkeypatch):
    """Three steps of megatron's bf16 optimizer with ``patches`` applied, gradients well above
    --clip-grad 1.0: (grad norms, bf16 parameters, fp32 main parameters, fused clips run)."""
    from megatron.patchset.core import registry
    from megatron.patchset.features.torch_adam import clipping

    calls = []
    real = clipping.clip_scale
    monkeypatch.setattr(clipping, "clip_scale", lambda *a: calls.append(a) or real(*a))
    start, grads = _params(3)
    applied = registry.apply_patches(patches)
    try:
        model = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in start]
        opt = _megatron_optimizer(model, group)
        norms = []
        for step_grads in grads[:3]:
            for p, g in zip(model, step_grads):
                p.grad = (g * 50).to(torch.bfloat16)
            ok, norm, _ = opt.step()
            assert ok
            norms.append(float(norm))
        main = [p.detach().clone() for g in opt.fp32_from_float16_groups for p in g]
        kernel = getattr(opt.optimizer, "_plan", None) is not None  # the one-kernel step ran
        return norms, [p.detach().clone() for p in model], main, len(calls), kernel
    finally:
        registry.revert(applied)
        monkeypatch.undo()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_megatrons_step_with_the_fused_clip_and_copy_equals_its_own_passes(
    one_rank_group, monkeypatch, impl
):
    """megatron-core's bf16 optimizer, once with the feature's patches for ``impl`` and once with
    only torch's Adam in place of TE's (megatron's own clip pass and per-parameter copy): the same
    grad norms and, within fp32 rounding, the same parameters; the fused clip did run, and the
    bf16 parameters are the round-to-nearest-even copies of the main ones."""
    from megatron.patchset.core import registry
    from tests.unit.conftest import parse

    patches = [
        p
        for p in registry.selected(parse(tiny_argv("--adam-impl", impl)))
        if p.feature == "torch_adam"
    ]
    torch_args = parse(tiny_argv(*TORCH))
    adam_only = [p for p in registry.selected(torch_args) if p.name == "torch_adam.fused_step"]
    norms, model, main, calls, kernel = _train_megatrons_optimizer(
        patches, one_rank_group, monkeypatch
    )
    ref_norms, _, ref_main, ref_calls, _ = _train_megatrons_optimizer(
        adam_only, one_rank_group, monkeypatch
    )
    assert calls == 3 and ref_calls == 0
    assert kernel == (impl == "triton")
    assert min(norms) > 2.0  # every step clipped
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(main, ref_main):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for m, a in zip(main, model):
        assert torch.equal(a, m.to(torch.bfloat16))  # the foreach copy rounds like copy_
