#!/usr/bin/env python3
"""GPU time of the passes around the reference config's optimizer step, each form replayed as a
CUDA graph (one GPU; the shapes are the reference config's: 5 layers, 128 experts of 2048 -> 2x768
-> 2048, 3.72 B parameters in 1,318 tensors).

    python tools/bench/kernel_timings.py [--reps 10] [--passes NAME ...]

Prints one line per pass:

* the experts' bf16 weight gradients added into fp32 main grads that lie in reverse expert order
  (DDP's layout): an add per expert, a reversed copy plus one add, and grouped_mm's Triton kernel,
  with whether the kernel's sums equal the per-expert adds to the bit;
* the copy of the fp32 main parameters to bf16: one copy per tensor (megatron-core's bf16 path)
  and one ``_foreach_copy_``, with whether they agree to the bit;
* torch's fused capturable AdamW over 1.0 B parameters: alone, after a separate scaling pass of the
  gradients (megatron's clip), and with the scale as the optimizer's ``grad_scale``;
* the whole bf16 step over 1.0 B parameters in the reference config's tensor shapes: torch's fused
  AdamW with ``grad_scale`` plus ``_foreach_copy_`` to bf16 (``--adam-impl torch``) against the
  one Triton kernel (``--adam-impl triton``), with the largest difference of the fp32 parameters
  after one step and whether the kernel's bf16 parameters are the copy's to the bit;
* the experts' probability-weighted SwiGLU, forward and backward over 32,768 rows of 2 x 768 (4096
  tokens at top-8): megatron-core's compiled functions against the Triton kernels of
  ``--moe-swiglu-triton``, with the largest difference of the probability gradients and whether
  each gives the first 32,768 rows the same bits among 40,960 rows (a capacity factor of 1.25).
"""

from __future__ import annotations

import argparse
import sys

EXPERTS, LAYERS = 128, 5
EXPERT_SHAPES = ((1536, 2048), (2048, 768))  # fc1 (gated), fc2: (out, in)
DENSE_SHAPES = [(151936, 2048)] * 2 + [(2048,)] * 30 + [(5120, 2048), (2048, 4096), (128, 2048)] * 5


def graph_ms(fn, reps: int) -> float:
    """Mean GPU time of one replay of ``fn`` captured as a CUDA graph (after one eager warm-up)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def weight_gradient_accumulation(reps: int) -> str:
    import torch

    from megatron.patchset.features.grouped_mm import torch_grouped_gemm

    stacks = [
        torch.zeros(EXPERTS, *shape, device="cuda")
        for _ in range(LAYERS)
        for shape in EXPERT_SHAPES
    ]
    grads = [torch.randn(s.shape, device="cuda").to(torch.bfloat16) for s in stacks]

    def per_expert():
        for stack, dw in zip(stacks, grads):
            for e, part in enumerate(dw.unbind(0)):
                stack[EXPERTS - 1 - e].add_(part)

    def reversed_copy():
        for stack, dw in zip(stacks, grads):
            stack.add_(dw.flip(0))

    def triton_kernel():
        for stack, dw in zip(stacks, grads):
            torch_grouped_gemm.add_reversed(stack, dw)

    times = {
        n: graph_ms(f, reps)
        for n, f in [
            ("per expert", per_expert),
            ("reversed copy + add", reversed_copy),
            ("triton", triton_kernel),
        ]
    }
    for stack in stacks:
        stack.normal_()
    start = [s.clone() for s in stacks]
    per_expert()
    expected = [s.clone() for s in stacks]
    for stack, s in zip(stacks, start):
        stack.copy_(s)
    triton_kernel()
    same = all(torch.equal(a, b) for a, b in zip(stacks, expected))
    params = sum(s.numel() for s in stacks) / 1e9
    return (
        f"expert wgrad bf16 -> reversed fp32 main grads ({params:.2f} B): "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items())
        + f"; triton bitwise equal to per expert: {same}"
    )


def main_to_model_copy(reps: int) -> str:
    import torch

    shapes = DENSE_SHAPES + [
        s for _ in range(LAYERS) for s in EXPERT_SHAPES for _ in range(EXPERTS)
    ]
    shapes = shapes[:1318]
    main = [torch.randn(s, device="cuda") for s in shapes]
    model = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]

    def per_tensor():
        for src, dst in zip(main, model):
            dst.copy_(src)

    def foreach():
        torch._foreach_copy_(model, main)

    t_loop, t_foreach = graph_ms(per_tensor, reps), graph_ms(foreach, reps)
    per_tensor()
    expected = [m.clone() for m in model]
    foreach()
    same = all(torch.equal(a, b) for a, b in zip(model, expected))
    params = sum(m.numel() for m in main) / 1e9
    return (
        f"fp32 -> bf16 copy ({len(main)} tensors, {params:.2f} B): per tensor {t_loop:.2f} ms, "
        f"_foreach_copy_ {t_foreach:.2f} ms; bitwise equal: {same}"
    )


def adam_with_clip(reps: int) -> str:
    import torch

    n, count = 250_000_000, 4
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(n, device="cuda")
    opt = torch.optim.AdamW(
        params, lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True
    )
    opt.step()
    coeff = torch.tensor(0.5, device="cuda")

    def scale_then_step():
        torch._foreach_mul_([p.grad for p in params], coeff)
        opt.step()

    def grad_scale():
        opt.grad_scale = coeff
        opt.step()
        opt.grad_scale = None

    return (
        f"fused AdamW over {n * count / 1e9:.1f} B: step {graph_ms(opt.step, reps):.2f} ms, "
        f"scaling pass + step {graph_ms(scale_then_step, reps):.2f} ms, step with grad_scale "
        f"{graph_ms(grad_scale, reps):.2f} ms"
    )


def adam_step_and_copy(reps: int) -> str:
    import torch

    from megatron.patchset.features.torch_adam import triton_step

    shapes = [(151936, 2048)] * 2 + [(1536, 2048), (2048, 768)] * 80 + [(2048,)] * 30
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device="cuda", generator=gen) * 1e-3 for s in shapes]
    scale = torch.tensor(2.0, device="cuda")
    kw = dict(lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.1, fused=True, capturable=True)

    def setup(cls):
        """An optimizer built over bf16 model parameters whose fp32 main copies then take their
        places, as megatron's bf16 optimizer arranges them."""
        models = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in start]
        opt = cls(models, **kw)
        mains = []
        for i, model in enumerate(models):
            main = torch.nn.Parameter(start[i].clone())
            main.grad = grads[i]
            opt.param_groups[0]["params"][i] = main
            model.main_param = main
            mains.append(main)
        return opt, models, mains

    ref, ref_models, ref_mains = setup(torch.optim.AdamW)

    def torch_step():
        ref.grad_scale = scale
        ref.step()
        ref.grad_scale = None
        torch._foreach_copy_([m.data for m in ref_models], [m.data for m in ref_mains])

    t_torch = graph_ms(torch_step, reps)
    del ref, ref_models, ref_mains
    torch.cuda.empty_cache()
    ours, models, mains = setup(triton_step.TritonAdamW)

    def triton_one_kernel():
        ours.grad_scale = scale
        ours.step()
        ours.grad_scale = None

    t_triton = graph_ms(triton_one_kernel, reps)
    # One step each from the same state.
    ref, ref_models, ref_mains = setup(torch.optim.AdamW)
    del ours, models, mains
    torch.cuda.empty_cache()
    ours, models, mains = setup(triton_step.TritonAdamW)
    torch_step()
    triton_one_kernel()
    diff = max((a - b).abs().max().item() for a, b in zip(mains, ref_mains))
    same = all(torch.equal(m, p.to(torch.bfloat16)) for m, p in zip(models, mains))
    params = sum(p.numel() for p in start) / 1e9
    return (
        f"bf16 AdamW step with grad_scale over {params:.2f} B in {len(shapes)} tensors: torch "
        f"fused + _foreach_copy_ {t_torch:.2f} ms, one Triton kernel {t_triton:.2f} ms (aligned: "
        f"{ours.aligned}); max |param diff| after one step {diff:.2e}; bf16 copies "
        f"bitwise equal: {same}"
    )


def weighted_swiglu(reps: int) -> str:
    import torch
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    from megatron.patchset.features.triton_swiglu import kernels

    rows, padded, ffn = 4096 * 8, 4096 * 10, EXPERT_SHAPES[1][1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = (2 * torch.randn(padded, 2 * ffn, generator=gen, device="cuda")).to(torch.bfloat16)
    probs = torch.rand(padded, 1, generator=gen, device="cuda")
    grad = torch.randn(padded, ffn, generator=gen, device="cuda").to(torch.bfloat16)
    impls = {
        "megatron-core's compiled functions": lambda a, p: weighted_bias_swiglu_impl(a, None, p),
        "the Triton kernels": kernels.weighted_swiglu,
    }

    def probs_grad(fn, n):
        a, p = y[:n].clone().requires_grad_(), probs[:n].clone().requires_grad_()
        return torch.autograd.grad(fn(a, p), (a, p), grad[:n])[1][:rows]

    def forward_backward(fn):
        a, p = y[:rows].clone().requires_grad_(), probs[:rows].clone().requires_grad_()
        return lambda: torch.autograd.grad(fn(a, p), (a, p), grad[:rows])

    timed, grads, same = [], [], []
    for name, fn in impls.items():
        timed.append(f"{name} {graph_ms(forward_backward(fn), reps):.3f} ms")
        grads.append(probs_grad(fn, rows))
        kept = torch.equal(probs_grad(fn, padded), grads[-1])
        same.append(f"{name} {'the same' if kept else 'other'}")
    diff = (grads[0] - grads[1]).abs().max().item()
    return (
        f"weighted SwiGLU forward + backward, {rows:,} rows of 2 x {ffn} (bf16): "
        f"{', '.join(timed)}; probability gradients differ by at most {diff:.2e}; the first "
        f"{rows:,} rows' probability gradients among {padded:,} rows: {', '.join(same)} bits"
    )


PASSES = (
    weight_gradient_accumulation,
    main_to_model_copy,
    adam_with_clip,
    adam_step_and_copy,
    weighted_swiglu,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="tools/bench/kernel_timings.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=10, help="Graph replays per timing.")
    parser.add_argument(
        "--passes",
        nargs="+",
        choices=[measure.__name__ for measure in PASSES],
        default=[measure.__name__ for measure in PASSES],
        help="The passes to time (default: all, in this order).",
    )
    opts = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("tools/bench/kernel_timings.py: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for measure in PASSES:
        if measure.__name__ not in opts.passes:
            continue
        print(measure(opts.reps), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
