"""--moe-grouped-gemm-impl torch on GPUs.

* The GEMMs against TransformerEngine's GroupedLinear at the reference shape (128 experts, 2048 ->
  1536, bf16, a skewed routing with empty experts): output, input gradient, and weight gradients
  both returned and accumulated into fp32 ``main_grad``; and the kernel launches of one forward +
  backward, TE's one-GEMM-per-expert against ours.
* Training: the tiny MoE config trains with either implementation to the same losses and gradient
  norms within bf16 tolerance over 20 iterations -- one GPU, one GPU with TE partial CUDA graphs
  around the experts, and two GPUs with EP=2, the distributed optimizer and overlapped gradient
  reduction (which relies on the per-parameter DDP hooks the weight-gradient path must keep firing).
* ``--moe-expert-splits-on-device``: the same against TE with the token counts left on the GPU, and
  with the whole forward and backward captured as one CUDA graph (``--cuda-graph-impl
  full_iteration``); under ``--deterministic-mode`` the replayed graph equals the eager run bit for
  bit, also with the experts' activation recomputed in the backward (``--recompute-modules
  moe_act``). Negative control: unpatched megatron-core cannot capture the same step.
"""

import math

import pytest

from megatron.patchset.features.grouped_mm import linears, torch_grouped_gemm
from tests.gpu.conftest import assert_same_bits, gpu_count, launch_many, tiny_argv

pytestmark = pytest.mark.gpu

EXPERTS, IN, OUT, TOKENS = 128, 2048, 1536, 4096 * 8
ITERS = 20
# Same parameters and inputs; only the GEMMs' summation order differs (CUTLASS vs cuBLAS, both
# fp32 accumulation), then a changed top-2 choice can move a token to another expert.
FIRST_LOSS_ATOL = 5e-3
LOSS_ATOL = 2e-2
GRAD_NORM_RTOL = 5e-2
TORCH_IMPL = ("--moe-grouped-gemm-impl", "torch")
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
GRAPHS = (
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
    "moe_preprocess",
    "--cuda-graph-warmup-steps",
    "2",
)


def skewed_splits(torch, seed=0):
    """Token counts per expert: a Zipf-like routing with the last eight experts empty."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** 0.8
    weights[-8:] = 0
    counts = torch.bincount(
        torch.multinomial(weights, TOKENS, replacement=True, generator=gen), minlength=EXPERTS
    )
    return counts.tolist()


def relative_error(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpus(1)
def test_gemms_match_transformer_engine():
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    splits = skewed_splits(torch)
    assert 0 in splits and sum(splits) == TOKENS
    te_linear = te.GroupedLinear(
        EXPERTS, IN, OUT, bias=False, params_dtype=torch.bfloat16, device="cuda"
    )
    weights = [
        torch.nn.Parameter(getattr(te_linear, f"weight{i}").detach().clone())
        for i in range(EXPERTS)
    ]
    x = torch.randn(TOKENS, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, OUT, device="cuda", dtype=torch.bfloat16)

    x_te = x.clone().requires_grad_(True)
    out_te = te_linear(x_te, splits)
    out_te.backward(dy)
    x_ours = x.clone().requires_grad_(True)
    out = linears.grouped_mm(x_ours, splits, weights)
    out.backward(dy)
    errors = {
        "output": relative_error(out, out_te),
        "input grad": relative_error(x_ours.grad, x_te.grad),
        "weight grad": max(
            relative_error(w.grad, getattr(te_linear, f"weight{i}").grad)
            for i, w in enumerate(weights)
            if splits[i]
        ),
    }
    print(f"\nrelative max error vs TE GroupedLinear: {errors}")
    assert all(e < 1e-2 for e in errors.values()), errors
    assert all(torch.count_nonzero(w.grad) == 0 for w, n in zip(weights, splits) if n == 0)

    # Accumulation into fp32 main_grad, as under megatron's DDP.
    for w in weights:
        w.grad = None
        w.main_grad = torch.ones(w.shape, dtype=torch.float32, device="cuda")
        w.grad_added_to_main_grad = False
    linears.grouped_mm(x, splits, weights, fuse_accumulation=True).backward(dy)
    worst = max(
        relative_error(w.main_grad - 1, getattr(te_linear, f"weight{i}").grad)
        for i, w in enumerate(weights)
        if splits[i]
    )
    print(
        f"main_grad accumulation: relative max error {worst:.2e}; fp32 wgrad from the GEMM: "
        f"{torch_grouped_gemm._fp32_wgrad_supported.get('cuda')}"
    )
    assert worst < 1e-2
    assert all(w.grad_added_to_main_grad for w in weights)


def kernels_launched(torch, fn):
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up (TE's workspace, CUTLASS's kernel selection)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpus(1)
def test_one_launch_per_gemm_instead_of_one_per_expert():
    import torch
    import transformer_engine.pytorch as te

    splits = skewed_splits(torch, seed=1)
    te_linear = te.GroupedLinear(
        EXPERTS, IN, OUT, bias=False, params_dtype=torch.bfloat16, device="cuda"
    )
    weights = [
        torch.nn.Parameter(getattr(te_linear, f"weight{i}").detach().clone())
        for i in range(EXPERTS)
    ]
    x = torch.randn(TOKENS, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, OUT, device="cuda", dtype=torch.bfloat16)
    # As under megatron's DDP: fp32 main grads back to back in one buffer, in reverse order.
    buffer = torch.zeros(EXPERTS, OUT, IN, dtype=torch.float32, device="cuda")
    for i, w in enumerate(weights):
        w.main_grad = buffer[EXPERTS - 1 - i]
        w.grad_added_to_main_grad = False
    te_kernels = kernels_launched(torch, lambda: te_linear(x, splits).backward(dy))

    def ours():
        for w in weights:  # what DDP's hook does after each backward
            w.grad = None
        linears.grouped_mm(x, splits, weights, fuse_accumulation=True).backward(dy)

    our_kernels = kernels_launched(torch, ours)
    print(
        f"\nGPU kernels for one forward + backward of {EXPERTS} experts: TE {te_kernels}, torch "
        f"grouped_mm {our_kernels} (weight gradients into DDP-style main grads)"
    )
    assert te_kernels >= 3 * (EXPERTS - 8)  # TE on Hopper: a GEMM per non-empty expert, three times
    assert our_kernels <= 40


PERMUTE_FUSION = ("--moe-permute-fusion",)
NO_NAN_CHECK = (
    "--no-check-for-nan-in-loss-and-grad",
)  # megatron requires it for full-iteration graphs
SPLITS = ("--moe-expert-splits-on-device",)
FULL_GRAPH = (
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
    "--logging-level",
    "20",
)
CAPTURED = "CUDA graph capture done for training"
EP2 = ("--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce")

# name: (GPUs, flags of both runs, flags of ours only); the other run is TE's GroupedLinear.
LAYOUTS = {
    "gmm_1gpu": (1, (), TORCH_IMPL),
    "gmm_1gpu_graphs": (1, GRAPHS, TORCH_IMPL),
    "gmm_2gpu_ep2": (2, EP2, TORCH_IMPL),
    # The token counts stay on the GPU; then the whole forward and backward as one CUDA graph.
    "splits_1gpu": (1, PERMUTE_FUSION + NO_NAN_CHECK, TORCH_IMPL + SPLITS),
    "full_graph_1gpu": (1, PERMUTE_FUSION + NO_NAN_CHECK, TORCH_IMPL + SPLITS + FULL_GRAPH),
}
RECOMPUTE_MOE_ACT = ("--recompute-granularity", "selective", "--recompute-modules", "moe_act")
DETERMINISTIC = (
    ("--deterministic-mode", "--te-rng-tracker")
    + PERMUTE_FUSION
    + NO_NAN_CHECK
    + TORCH_IMPL
    + SPLITS
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grouped_mm")
    jobs = []
    for name, (nproc, common, ours) in LAYOUTS.items():
        if gpu_count() < nproc:
            continue
        argv = tiny_argv("--train-iters", str(ITERS), *NO_DROPOUT, *common)
        jobs.append(dict(tmp_path=tmp, name=f"{name}_te", nproc=nproc, argv=argv))
        jobs.append(dict(tmp_path=tmp, name=f"{name}_torch", nproc=nproc, argv=argv + list(ours)))
    if gpu_count() >= 1:
        det = tiny_argv("--train-iters", str(ITERS), *NO_DROPOUT, *DETERMINISTIC)
        jobs.append(dict(tmp_path=tmp, name="det_eager", nproc=1, argv=det))
        jobs.append(dict(tmp_path=tmp, name="det_full_graph", nproc=1, argv=det + list(FULL_GRAPH)))
        recompute = det + list(FULL_GRAPH) + list(RECOMPUTE_MOE_ACT)
        jobs.append(dict(tmp_path=tmp, name="det_full_graph_recompute", nproc=1, argv=recompute))
    return launch_many(jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_te(runs, layout):
    if gpu_count() < LAYOUTS[layout][0]:
        pytest.skip(f"needs {LAYOUTS[layout][0]} GPUs")
    te_run, ours = runs[f"{layout}_te"], runs[f"{layout}_torch"]
    assert len(te_run.losses) == len(ours.losses) == ITERS
    assert all(math.isfinite(x) for x in ours.losses)
    assert (
        "megatron-patchset: experts' GroupedMMColumnParallelGroupedLinear runs" in ours.log_text()
    )
    assert "GroupedMM" not in te_run.log_text()
    if "--cuda-graph-impl" in LAYOUTS[layout][2]:
        assert CAPTURED in ours.log_text()
    loss_diff = [abs(a - b) for a, b in zip(ours.losses, te_run.losses)]
    norm_diff = [abs(a - b) / b for a, b in zip(ours.grad_norms, te_run.grad_norms)]
    print(
        f"\n{layout}: max |loss diff| {max(loss_diff):.5f} (first {loss_diff[0]:.5f}), max "
        f"grad-norm rel diff {max(norm_diff):.4f}; loss {ours.losses[0]:.3f} -> "
        f"{ours.losses[-1]:.3f}; median step TE {te_run.step_ms():.1f} ms, torch "
        f"{ours.step_ms():.1f} ms (runs share the GPUs)"
    )
    assert loss_diff[0] < FIRST_LOSS_ATOL
    assert max(loss_diff) < LOSS_ATOL
    assert max(norm_diff) < GRAD_NORM_RTOL
    assert ours.losses[-1] < ours.losses[0] - 2.0


@pytest.mark.gpus(1)
def test_full_iteration_graph_replays_the_eager_step_bitwise(runs):
    """--deterministic-mode: the captured forward and backward (iterations 3-20 replay it) gives the
    eager run's losses and gradient norms bit for bit."""
    eager, graphed = runs["det_eager"], runs["det_full_graph"]
    assert CAPTURED in graphed.log_text() and CAPTURED not in eager.log_text()
    assert_same_bits(graphed, eager, f"full-iteration graph vs eager, {ITERS} iterations", ITERS)


@pytest.mark.gpus(1)
def test_the_experts_activation_recomputes_inside_the_full_iteration_graph(runs):
    """--recompute-modules moe_act (a lever of the small_batch recipe's MEMORY=<N>G): megatron's
    checkpoint of the experts' activation function replays inside the captured backward, and the
    recomputed activations are the stored ones: the losses and gradient norms of the eager run,
    bit for bit."""
    eager, graphed = runs["det_eager"], runs["det_full_graph_recompute"]
    assert CAPTURED in graphed.log_text()
    assert_same_bits(
        graphed, eager, "moe_act recomputed in the full-iteration graph vs eager", ITERS
    )


@pytest.mark.gpus(1)
def test_upstream_cannot_capture_a_dropless_moe_step(tmp_path):
    """Unpatched megatron-core with the same full-iteration graph flags: the dispatcher's
    device-to-host copy of the token counts (and TE's host split) fails the capture."""
    argv = tiny_argv("--train-iters", "6", *NO_DROPOUT, *PERMUTE_FUSION, *NO_NAN_CHECK, *FULL_GRAPH)
    # The fork's launcher refuses this combination before any GPU work; skip that one rule here.
    env = {
        "MEGATRON_PATCHSET": "off",
        "MEGATRON_PATCHSET_SKIP_RULES": "full-iteration-graphs-dropless-moe",
    }
    run = launch_many(
        [
            dict(
                tmp_path=tmp_path,
                name="upstream_full_graph",
                nproc=1,
                argv=argv,
                env=env,
                check=False,
            )
        ],
        timeout=300,
    )["upstream_full_graph"]
    log = run.log_text()
    errors = [line for line in log.splitlines() if "Error" in line or "captur" in line][-8:]
    print(
        f"\nupstream full-iteration graph: exit {run.returncode}, {len(run.losses)} iterations; "
        "errors:\n" + "\n".join(errors)
    )
    assert "rule full-iteration-graphs-dropless-moe skipped" in log
    assert run.returncode != 0
    assert len(run.losses) <= 2  # the two warm-up iterations at most; the capture is the third
    assert "Capture CUDA graph for training" in log and CAPTURED not in log
    # The dispatcher waits on its device-to-host event inside the capture.
    assert (
        "cudaErrorCapturedEvent" in log or "operation not permitted when stream is capturing" in log
    )


@pytest.mark.gpus(1)
@pytest.mark.parametrize("experts,k,n,pad", [(4, 256, 512, 1000), (16, 2048, 1536, 8192)])
def test_zero_rows_after_the_last_group_change_no_bit_of_the_real_rows(experts, k, n, pad):
    """The static dispatch hands the experts a buffer with zero rows after the last expert's:
    torch's grouped GEMM gives the real rows' output, input gradient and weight gradients the same
    bits with or without them."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    counts = torch.randint(0, 75, (experts,)) * 8
    total = int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    xp = torch.cat([x, x.new_zeros(pad, k)])
    dyp = torch.cat([dy, dy.new_zeros(pad, n)])
    wt = w.transpose(1, 2)
    assert torch.equal(F.grouped_mm(x, wt, offs=offs), F.grouped_mm(xp, wt, offs=offs)[:total])
    assert torch.equal(F.grouped_mm(dy, w, offs=offs), F.grouped_mm(dyp, w, offs=offs)[:total])
    assert torch.equal(F.grouped_mm(dy.t(), x, offs=offs), F.grouped_mm(dyp.t(), xp, offs=offs))


@pytest.mark.gpus(1)
def test_descending_row_groups_give_the_expert_order_bits():
    """With the expert weights and fp32 main grads in DDP's buffers (expert ``e`` at index
    ``n - 1 - e``, as under the distributed optimizer), the static dispatch lays the rows out from
    the last expert to the first and the GEMMs read the weights in place. Against the rows in
    expert order (which stack a copy of the weights per GEMM), at the shape of a Qwen3-30B-A3B rank
    at EP 8 with padding rows: every output row, data gradient and main grad has the same bits."""
    import torch

    experts, k, n, pad = 16, 2048, 1536, 1000
    torch.manual_seed(0)
    counts = torch.randint(0, 600, (experts,))
    counts[3] = 0
    total = int(counts.sum())
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(total, n, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    starts = [int(counts[:e].sum()) for e in range(experts)]
    down_rows = [
        i for e in reversed(range(experts)) for i in range(starts[e], starts[e] + counts[e])
    ]
    down_rows = torch.tensor(down_rows, device="cuda")

    def ddp_layout():
        params = values.flip(0).contiguous()
        grads = torch.full((experts, n, k), 0.25, device="cuda")
        weights = []
        for e in range(experts):
            w = torch.nn.Parameter(params[experts - 1 - e])
            w.main_grad = grads[experts - 1 - e]
            w.grad_added_to_main_grad = False
            weights.append(w)
        return weights

    def run(weights, rows, splits):
        xp = torch.cat([x[rows], x.new_zeros(pad, k)]).requires_grad_(True)
        out = linears.grouped_mm(xp, splits, weights, fuse_accumulation=True)
        out.backward(torch.cat([dy[rows], dy.new_zeros(pad, n)]))
        return out[:total].detach(), xp.grad[:total], [w.main_grad for w in weights]

    in_order = torch.arange(total, device="cuda")
    up = run(ddp_layout(), in_order, linears.DeviceSplits(counts.cuda(), padded=True))
    down_splits = linears.DeviceSplits(counts.flip(0).cuda(), padded=True, descending=True)
    down = run(ddp_layout(), down_rows, down_splits)
    assert torch.equal(down[0], up[0][down_rows])
    assert torch.equal(down[1], up[1][down_rows])
    for a, b in zip(up[2], down[2]):
        assert torch.equal(a, b)
    assert not torch.equal(up[2][0], torch.full_like(up[2][0], 0.25))
