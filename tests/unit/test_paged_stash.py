"""MoE paged stashing on Hopper (megatron/patchset/paged_stash.py): the validation rules with
megatron's real parser, the registry entries, and on CPU tensors the TE op patches (slack rows
of a static expert buffer, the saved input megatron's real paged-stash hook pages), the HybridEP
budget restored on graph replay and the overflow report.

TransformerEngine is not installed here; the TE op patches are tested as subclasses of a small
stand-in written for these tests that keeps TE 2.20.2's split-path contract: host split sizes,
``torch.split`` of the whole input (which raises when the sizes do not cover every row), the
saved-tensor layout ``[split_sizes, 4 x offsets, *inputs, *weights]`` and ``dgrad_out``.
"""

import math
import types

import pytest
import torch

from megatron.patchset import arguments as ps_args
from megatron.patchset import paged_stash as ps
from megatron.patchset import patches
from tests.unit.conftest import parse, tiny_argv

STASH = (
    "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
    "--moe-flex-dispatcher-backend", "hybridep", "--moe-expert-rank-capacity-factor", "1.5",
    "--use-transformer-engine-op-fuser", "--moe-router-dtype", "fp32", "--moe-paged-stash",
)
GRAPHS = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router", "moe_preprocess")
OURS = {"paged-stash-requirements", "rank-capacity-factor-backend", "paged-stash-op-fuser-expert-mlp",
        "paged-stash-precision", "paged-stash-recompute", "paged-stash-cuda-graphs", "paged-stash-buffer-sizes",
        "ncclep-static-shape", "paged-stash-ncclep-static-shape"}
NCCLEP_STASH = (
    "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
    "--moe-flex-dispatcher-backend", "ncclep", "--moe-ncclep-static-shape", "--moe-expert-rank-capacity-factor", "2.0",
    "--use-transformer-engine-op-fuser", "--moe-paged-stash",
)


@pytest.fixture(autouse=True)
def cutedsl_env(monkeypatch):
    monkeypatch.setenv(ps.CUTEDSL_ENV, "1")


def failures(*extra, world_size=2, base=STASH):
    args = parse(tiny_argv(*base, *extra), world_size)
    try:
        ps_args.validate(args, "layout")
    except ps_args.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures if rule.name in OURS}
    return {}


# ---------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------


def test_reference_paged_stash_configs_are_valid():
    assert failures() == {}
    assert failures(*GRAPHS) == {}
    assert failures("--moe-paged-stash-buffer-size-factor-cuda", "0.5", "--moe-paged-stash-buffer-size-factor-cpu", "1.0") == {}
    # the static budget alone (no stash) with graphs is fine too
    assert failures(*GRAPHS, base=STASH[:-1]) == {}


def test_ncclep_paged_stash_configs_are_valid():
    assert failures(base=NCCLEP_STASH) == {}
    assert failures(*GRAPHS, base=NCCLEP_STASH) == {}
    # the static budget alone (no stash), with and without the static shape
    assert failures(*GRAPHS, base=NCCLEP_STASH[:-1]) == {}
    assert failures(base=[a for a in NCCLEP_STASH[:-1] if a != "--moe-ncclep-static-shape"]) == {}


def test_ncclep_paged_stash_needs_static_shape():
    base = [a for a in NCCLEP_STASH if a != "--moe-ncclep-static-shape"]
    msg = failures(base=base)["paged-stash-ncclep-static-shape"]
    assert "needs --moe-ncclep-static-shape" in msg and "overflow" in msg
    assert set(failures(base=base)) == {"paged-stash-ncclep-static-shape"}


def test_ncclep_static_shape_requirements():
    base = [a for a in NCCLEP_STASH[:-1] if a != "--use-transformer-engine-op-fuser"]
    msg = failures(base=base)["ncclep-static-shape"]
    assert msg.startswith("--moe-ncclep-static-shape needs") and "--use-transformer-engine-op-fuser" in msg
    base = [a for a in NCCLEP_STASH if a != "--moe-ncclep-static-shape"][:-1] + ["--moe-ncclep-zero-copy"]
    assert "--moe-ncclep-static-shape (zero-copy" in failures(base=base)["ncclep-static-shape"]
    msg = failures("--moe-ncclep-static-shape")["ncclep-static-shape"]  # on hybridep
    assert "--moe-flex-dispatcher-backend ncclep" in msg


def test_paged_stash_requirements():
    base = [a for a in STASH if a not in ("--moe-expert-rank-capacity-factor", "1.5", "--use-transformer-engine-op-fuser")]
    got = failures(base=base)
    msg = got["paged-stash-requirements"]
    assert "--moe-expert-rank-capacity-factor" in msg and "--use-transformer-engine-op-fuser" in msg
    got = failures("--cpu-offloading-num-layers", "1", "--offload-modules", "expert_fc1", "moe_act")
    msg = got["paged-stash-requirements"]
    assert "--cpu-offloading-num-layers" in msg and "expert_fc1, moe_act" in msg


def test_rank_capacity_factor_backend():
    base = list(STASH[:-1])
    base[base.index("hybridep")] = "deepep"
    got = failures(base=base)
    assert "--moe-flex-dispatcher-backend hybridep or ncclep (got deepep)" in got["rank-capacity-factor-backend"]
    base = [a for a in STASH[:-1] if a != "--use-transformer-engine-op-fuser"]
    assert "--use-transformer-engine-op-fuser with hybridep" in failures(base=base)["rank-capacity-factor-backend"]
    base = list(STASH[:-1])
    base[base.index("flex")] = "alltoall"
    assert "--moe-token-dispatcher-type flex (got alltoall)" in failures(base=base)["rank-capacity-factor-backend"]
    base = list(STASH)
    base[base.index("1.5")] = "0"
    assert "a positive factor" in failures(base=base)["rank-capacity-factor-backend"]


def test_op_fuser_expert_mlp(monkeypatch):
    monkeypatch.delenv(ps.CUTEDSL_ENV)
    msg = failures()["paged-stash-op-fuser-expert-mlp"]
    assert f"{ps.CUTEDSL_ENV}=1 with --swiglu" in msg
    monkeypatch.setenv(ps.CUTEDSL_ENV, "1")
    got = failures("--expert-tensor-parallel-size", "2", "--moe-single-grouped-weight", "--moe-apply-probs-on-input",
                   world_size=4)
    msg = got["paged-stash-op-fuser-expert-mlp"]
    assert "--expert-tensor-parallel-size 1; got 2" in msg
    assert "--moe-single-grouped-weight" in msg and "--moe-apply-probs-on-input" in msg
    argv = [a for a in STASH] + ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
    assert "moe_act" in failures(base=argv)["paged-stash-op-fuser-expert-mlp"]
    no_swiglu = [a for a in tiny_argv(*STASH) if a != "--swiglu"]
    args = parse(no_swiglu, 2)
    with pytest.raises(ps_args.PatchsetArgumentError) as err:
        ps_args.validate(args, "layout")
    assert "an activation the op fuser implements" in str(err.value)


def test_paged_stash_precision():
    msg = failures("--fp8-format", "hybrid")["paged-stash-precision"]
    assert "--fp8-format" in msg and "--bf16" in msg


def test_paged_stash_recompute():
    msg = failures("--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1")["paged-stash-recompute"]
    assert "--recompute-granularity full" in msg
    msg = failures("--recompute-granularity", "selective", "--recompute-modules", "moe")["paged-stash-recompute"]
    assert "moe in --recompute-modules" in msg


def test_paged_stash_cuda_graphs():
    msg = failures("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe")["paged-stash-cuda-graphs"]
    assert "captures the experts" in msg and "attn moe_router moe_preprocess" in msg
    msg = failures("--cuda-graph-impl", "transformer_engine")["paged-stash-cuda-graphs"]
    assert "whole layers" in msg
    msg = failures(*GRAPHS, "--moe-hybridep-pad-uneven-dispatch-inputs")["paged-stash-cuda-graphs"]
    assert "--moe-hybridep-pad-uneven-dispatch-inputs" in msg
    msg = failures("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "1")["paged-stash-cuda-graphs"]
    assert "full_iteration" in msg and "--cuda-graph-warmup-steps 2 or more (got 1)" in msg


def test_paged_stash_buffer_sizes():
    msg = failures("--moe-paged-stash-page-size", "0", "--moe-paged-stash-buffer-size-factor-cuda", "0")["paged-stash-buffer-sizes"]
    assert "--moe-paged-stash-page-size 0" in msg and "every step would overflow" in msg
    assert failures("--moe-paged-stash-buffer-size-factor-cuda", "0", "--moe-paged-stash-buffer-size-factor-cpu", "1") == {}


def test_rules_are_silent_without_the_feature():
    assert failures(base=("--expert-model-parallel-size", "2", "--fp8-format", "hybrid")) == {}


def test_feature_listed():
    args = parse(tiny_argv(*STASH), 2)
    assert "moe-paged-stash-hopper" in [f.name for f in ps_args.enabled_features(args)]
    assert "moe-paged-stash-hopper" not in [f.name for f in ps_args.enabled_features(parse(tiny_argv(), 1))]


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------


def test_patches_registered_with_targets_and_switches():
    names = {p.name: p for p in patches.registered()}
    expected = {
        "paged_stash.te_expert_ops": ("megatron.core.transformer.moe.experts.TEGroupedMLP._make_fused_ops", "feature"),
        "paged_stash.hybridep_budget_on_graph_replay": (
            "megatron.core.transformer.moe.token_dispatcher._HybridEPManager.dispatch", "feature"),
        "paged_stash.report_buffers": (
            "megatron.core.transformer.moe.paged_stash.PagedStashManager.allocate_stash_buffers", "observe"),
        "paged_stash.report_overflow": (
            "megatron.core.transformer.moe.paged_stash.PagedStashRunner.check_moe_overflow", "observe"),
        "paged_stash.defer_result_checks": (
            "megatron.core.transformer.moe.paged_stash.PagedStashRunner.__init__", "feature"),
    }
    for name, (target, kind) in expected.items():
        assert names[name].target == target and names[name].kind == kind and names[name].reason
    stash = parse(tiny_argv(*STASH), 2)
    graphs = parse(tiny_argv(*STASH, *GRAPHS), 2)
    plain = parse(tiny_argv(), 1)
    wanted = lambda a: {p.name for p in patches.wanted(a) if p.name.startswith("paged_stash.")}  # noqa: E731
    assert wanted(plain) == set()
    assert wanted(stash) == set(expected) - {"paged_stash.hybridep_budget_on_graph_replay"}
    assert wanted(graphs) == set(expected)


def test_megatron_targets_resolve():
    for name in ("paged_stash.te_expert_ops", "paged_stash.hybridep_budget_on_graph_replay",
                 "paged_stash.report_buffers", "paged_stash.report_overflow", "paged_stash.defer_result_checks"):
        owner, attr = patches.resolve_owner(patches.get(name).target)
        assert callable(getattr(owner, attr))


def test_megatron_patches_apply_and_revert():
    from megatron.core.transformer.moe import paged_stash as upstream

    original = upstream.PagedStashRunner.check_moe_overflow
    names = ["paged_stash.report_overflow", "paged_stash.report_buffers", "paged_stash.hybridep_budget_on_graph_replay",
             "paged_stash.te_expert_ops", "paged_stash.defer_result_checks"]
    original_init = upstream.PagedStashRunner.__init__
    try:
        patches.apply_patches([patches.get(n) for n in names])
        assert patches.patched_by(upstream.PagedStashRunner.check_moe_overflow) == "paged_stash.report_overflow"
        assert patches.patched_by(upstream.PagedStashRunner.__init__) == "paged_stash.defer_result_checks"
    finally:
        patches.revert(names)
    assert upstream.PagedStashRunner.check_moe_overflow is original
    assert upstream.PagedStashRunner.__init__ is original_init


# ---------------------------------------------------------------------------------------
# TE op stand-ins and a fuser-like driver
# ---------------------------------------------------------------------------------------


class FakeTEGroupedLinear:
    """TE 2.20.2 ops.GroupedLinear's split path, reduced to bf16-free plain matmuls."""

    def __init__(self, weights):
        self.weights = weights
        self.weight0 = weights[0]
        self.num_groups = len(weights)
        self.out_features, self.in_features = weights[0].shape
        self._scale_bias = False
        self.single_grouped_weight = False

    def _fuser_forward_split_quantize(self, *, input_, split_sizes, scales, dtype, device, out_buffer=None, **_):
        sizes = [int(s) for s in split_sizes.tolist()]
        xs = torch.split(input_, sizes)  # raises unless the sizes cover every row, as in TE
        out = torch.empty((input_.shape[0], self.out_features), dtype=dtype) if out_buffer is None else out_buffer
        assert tuple(out.shape) == (input_.shape[0], self.out_features), "TE validate_or_alloc_output"
        out.copy_(torch.cat([x @ w.t() for x, w in zip(xs, self.weights)]))
        return out, (split_sizes, None, None, None, None, *xs, *self.weights)

    def fuser_forward_save_ctx(self, basic_op_ctxs, input_, tensors_to_save, *, requires_grad,
                               use_grouped_tensor_path, **_):
        ctx = basic_op_ctxs[0]
        ctx.to_save = tuple(tensors_to_save[0])
        ctx.dtype = self.weight0.dtype
        ctx.input_requires_grad = True
        ctx.dgrad_out = None

    def _fuser_backward_split_quantize(self, *, ctx, grad_output):
        saved = ctx.saved_tensors
        sizes = [int(s) for s in saved[0].tolist()]
        xs = saved[5 : 5 + self.num_groups]
        ws = saved[5 + self.num_groups :]
        dys = torch.split(grad_output, sizes)
        rows = grad_output.shape[0]
        dx = torch.empty((rows, self.in_features), dtype=ctx.dtype) if ctx.dgrad_out is None else ctx.dgrad_out
        assert tuple(dx.shape) == (rows, self.in_features)
        dx.copy_(torch.cat([dy @ w for dy, w in zip(dys, ws)]))
        dws = [dy.t() @ x for dy, x in zip(dys, xs)]
        return dx, [dws], [(None,)]


class FakeTEScaledSwiGLU:
    def fuser_forward(self, basic_op_ctxs, input_, **_):
        basic_op_ctxs[0].to_save = (input_,)
        return input_ * 2, [()]


PagedGL = ps.make_grouped_linear(FakeTEGroupedLinear)
PagedSwiGLU = ps.make_scaled_glu(FakeTEScaledSwiGLU)


class _FuserFunction(torch.autograd.Function):
    """Like TE's fuser: run the op's forward, save its to_save list through autograd."""

    @staticmethod
    def forward(func_ctx, x, op, split_sizes):
        ctx = types.SimpleNamespace(requires_grad=True)
        out, saved = op._fuser_forward_split_quantize(
            input_=x, split_sizes=split_sizes, scales=None, dtype=x.dtype, device=x.device)
        op.fuser_forward_save_ctx([ctx], x, [saved], requires_grad=[True], use_grouped_tensor_path=False)
        slots = [t is not None for t in ctx.to_save]
        func_ctx.save_for_backward(*[t for t in ctx.to_save if t is not None])
        func_ctx.slots, func_ctx.op, func_ctx.opctx = slots, op, ctx
        return out

    @staticmethod
    def backward(func_ctx, grad_out):
        it = iter(func_ctx.saved_tensors)
        ctx = func_ctx.opctx
        ctx.saved_tensors = tuple(next(it) if s else None for s in func_ctx.slots)
        dx, (dws,), _ = func_ctx.op._fuser_backward_split_quantize(ctx=ctx, grad_output=grad_out)
        func_ctx.dws = dws
        return dx, None, None


def run(op, x, sizes, grad):
    x = x.clone().requires_grad_(True)
    out = _FuserFunction.apply(x, op, torch.tensor(sizes))
    out.backward(grad)
    return out.detach(), x.grad


def make_case(rows=12, sizes=(3, 0, 4), width=5, out=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out, width, generator=g, dtype=torch.float64) for _ in sizes]
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    x[sum(sizes):] = float("nan")  # slack rows of a static buffer hold anything
    grad = torch.randn(rows, out, generator=g, dtype=torch.float64)
    return weights, x, list(sizes), grad


def reference(weights, x, sizes, grad):
    total = sum(sizes)
    xs, gs = torch.split(x[:total], sizes), torch.split(grad[:total], sizes)
    out = torch.cat([a @ w.t() for a, w in zip(xs, weights)])
    dx = torch.cat([g @ w for g, w in zip(gs, weights)])
    return out, dx


# ---------------------------------------------------------------------------------------
# Slack rows
# ---------------------------------------------------------------------------------------


def test_megatron_expert_ops_are_adopted():
    """The patch re-classes the ops megatron's _make_fused_ops built (TE classes passed in)."""
    weights = make_case()[0]
    other = torch.nn.Identity()
    ops = [FakeTEGroupedLinear(weights), FakeTEScaledSwiGLU(), FakeTEGroupedLinear(weights), other]
    assert ps.adopt_ops(ops, FakeTEGroupedLinear, FakeTEScaledSwiGLU) == 3
    assert [type(o).__name__ for o in ops] == ["PagedStashGroupedLinear", "PagedStashScaledSwiGLU",
                                               "PagedStashGroupedLinear", "Identity"]
    assert type(ops[0]) is type(ops[2]) and isinstance(ops[0], FakeTEGroupedLinear)
    assert ps.adopt_ops(ops, FakeTEGroupedLinear, FakeTEScaledSwiGLU) == 0  # idempotent
    _, x, sizes, grad = make_case()
    out, _ = run(ops[0], x, sizes, grad)  # slack rows now work
    assert torch.count_nonzero(out[sum(sizes):]) == 0

    class Fused:
        pass

    seen = {}

    def make_fused_ops(self):
        seen["ops"] = [FakeTEGroupedLinear(weights), FakeTEScaledSwiGLU()]
        return seen["ops"]

    import sys

    te_ops = types.ModuleType("transformer_engine.pytorch.ops")
    te_ops.ScaledSwiGLU = FakeTEScaledSwiGLU
    te_gl = types.ModuleType("transformer_engine.pytorch.ops.basic.grouped_linear")
    te_gl.GroupedLinear = FakeTEGroupedLinear
    saved = {k: sys.modules.get(k) for k in ("transformer_engine", "transformer_engine.pytorch",
                                            "transformer_engine.pytorch.ops", "transformer_engine.pytorch.ops.basic",
                                            "transformer_engine.pytorch.ops.basic.grouped_linear")}
    try:
        for k in saved:
            sys.modules[k] = types.ModuleType(k)
        sys.modules["transformer_engine.pytorch.ops"] = te_ops
        sys.modules["transformer_engine.pytorch.ops.basic.grouped_linear"] = te_gl
        wrapped = patches.get("paged_stash.te_expert_ops").factory(make_fused_ops)
        built = wrapped(Fused())
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    assert [type(o).__name__ for o in built] == ["PagedStashGroupedLinear", "PagedStashScaledSwiGLU"]


def test_split_path_without_patch_fails_on_slack_rows():
    weights, x, sizes, grad = make_case()
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        run(FakeTEGroupedLinear(weights), x, sizes, grad)


def test_slack_rows_get_zero_output_and_zero_input_grad():
    weights, x, sizes, grad = make_case()
    op = PagedGL(weights)
    out, dx = run(op, x, sizes, grad)
    ref_out, ref_dx = reference(weights, x, sizes, grad)
    total = sum(sizes)
    assert out.shape == (12, 6) and dx.shape == x.shape
    assert torch.equal(out[:total], ref_out) and torch.equal(dx[:total], ref_dx)
    assert torch.count_nonzero(out[total:]) == 0 and torch.count_nonzero(dx[total:]) == 0


def test_no_slack_rows_is_unchanged():
    weights, x, sizes, grad = make_case(rows=7)
    out, dx = run(PagedGL(weights), x, sizes, grad)
    base_out, base_dx = run(FakeTEGroupedLinear(weights), x, sizes, grad)
    assert torch.equal(out, base_out) and torch.equal(dx, base_dx)


def test_more_tokens_than_rows_is_a_clear_error():
    with pytest.raises(ps.SlackRowError, match="7 tokens .* only 5 rows"):
        ps.slack_rows([3, 4], 5)
    assert ps.slack_rows([3, 4], 9) == 2


def test_helpers():
    assert ps.rank_budget(4096, 2, 1.5, 256) == 12288
    assert ps.rank_budget(1000, 8, 1.1, 256) == 8960  # 8800 rounded up to 256
    assert ps.rank_budget(1000, 8, 1.1, None) == 8800
    padded = ps.pad_rows(torch.ones(2, 3), 4)
    assert padded.shape == (4, 3) and padded[2:].abs().sum() == 0 and padded[:2].sum() == 6


# ---------------------------------------------------------------------------------------
# Marking and megatron's real paged-stash hook (capture step, on the CPU)
# ---------------------------------------------------------------------------------------


@pytest.fixture
def manager(monkeypatch):
    from megatron.core.transformer.moe.paged_stash import PagedStashManager

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    mgr = PagedStashManager()
    monkeypatch.setattr(PagedStashManager, "STASH_MGR", mgr)
    mgr.enabled, mgr.status = True, "capture"
    mgr.current_vp_stage, mgr.current_schedule_index = 0, 0
    return mgr


def _enter(mgr, rows, total, avg=None):
    mgr.max_num_tokens = rows
    mgr.avg_num_tokens = avg
    mgr.num_tokens_tensor = torch.tensor(total)
    return torch.autograd.graph.saved_tensors_hooks(mgr.on_save_for_backward, mgr.on_get_saved_tensor)


def test_unpatched_op_is_not_paged(manager):
    """The blocker: TE's basic op saves unmarked per-expert views; megatron's hook pages nothing."""
    weights, x, sizes, grad = make_case(rows=7)
    with _enter(manager, rows=7, total=7):
        run(FakeTEGroupedLinear(weights), x, sizes, grad)
    assert not manager.max_tokens_across_vp_stages


def test_patched_op_input_is_paged_by_megatron_hook(manager):
    weights, x, sizes, grad = make_case()
    total = sum(sizes)
    with _enter(manager, rows=12, total=total, avg=8):
        out, dx = run(PagedGL(weights), x, sizes, grad)
    key = (torch.float64, 5)
    # megatron's capture step recorded the real tokens of our one [rows, width] input
    assert manager.max_tokens_across_vp_stages == {key: total}
    assert manager.max_avg_tokens_across_vp_stages == {key: 8}
    assert manager.temp_tokens_across_vp_stages[key] == 0  # released again in backward
    ref_out, ref_dx = reference(weights, x, sizes, grad)
    assert torch.equal(out[:total], ref_out) and torch.equal(dx[:total], ref_dx)
    assert torch.count_nonzero(dx[total:]) == 0


def test_weight_grads_survive_packing(manager):
    weights, x, sizes, grad = make_case()
    op = PagedGL(weights)
    x1 = x.clone().requires_grad_(True)
    with _enter(manager, rows=12, total=sum(sizes)):
        out = _FuserFunction.apply(x1, op, torch.tensor(sizes))
    captured = {}
    original = PagedGL._fuser_backward_split_quantize

    def spy(self, *, ctx, grad_output):
        result = original(self, ctx=ctx, grad_output=grad_output)
        captured["dws"] = result[1][0]
        return result

    PagedGL._fuser_backward_split_quantize = spy
    try:
        out.backward(grad)
    finally:
        PagedGL._fuser_backward_split_quantize = original
    total, start = sum(sizes), 0
    for w_grad, n in zip(captured["dws"], sizes):
        ref = grad[start : start + n].t() @ x[start : start + n]
        assert torch.allclose(w_grad, ref)
        start += n
    assert start == total


def test_marking_only_when_the_hook_expects_the_tensor(manager):
    t = torch.zeros(12, 4)
    manager.max_num_tokens = 12
    assert ps.stash_expects(t)
    manager.max_num_tokens = 10
    assert not ps.stash_expects(t)
    manager.enabled = False
    manager.max_num_tokens = 12
    assert not ps.stash_expects(t)


def test_swiglu_marks_its_saved_input(manager):
    manager.max_num_tokens = 12
    op, ctx = PagedSwiGLU(), types.SimpleNamespace(requires_grad=True)
    x = torch.zeros(12, 8)
    op.fuser_forward([ctx], x)
    assert getattr(ctx.to_save[0], ps.STASH_MARK) is False
    y = torch.zeros(9, 8)
    op.fuser_forward([ctx], y)
    assert not hasattr(y, ps.STASH_MARK)


def test_mark_for_stash_grouped_storage():
    data = torch.zeros(4, 2)
    storage = types.SimpleNamespace(rowwise_data=data, columnwise_data=None)
    assert ps.mark_for_stash(storage) and getattr(data, ps.STASH_MARK) is False
    quantized = types.SimpleNamespace(rowwise_data=torch.zeros(1), columnwise_data=torch.zeros(1))
    assert not ps.mark_for_stash(quantized) and not hasattr(quantized.columnwise_data, ps.STASH_MARK)
    assert not ps.mark_for_stash(None)


# ---------------------------------------------------------------------------------------
# HybridEP budget on graph replay, overflow report
# ---------------------------------------------------------------------------------------


def _hybridep_manager(**kw):
    cfg = types.SimpleNamespace(moe_router_topk=2)
    m = types.SimpleNamespace(config=cfg, moe_expert_rank_capacity_factor=1.5, num_permuted_tokens=None,
                              drop_and_pad=False, routing_map=torch.zeros(4096, 8, dtype=torch.bool),
                              _padded_num_tokens=None, _original_num_tokens=None)
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_budget_restored_on_replay():
    m = _hybridep_manager()
    assert ps.restore_static_budget(m, lambda cfg: 256)
    assert m.num_permuted_tokens == 12288 and m._padded_num_tokens == 4096 == m._original_num_tokens


def test_budget_left_alone_when_set_or_dropless():
    m = _hybridep_manager(num_permuted_tokens=777)
    assert not ps.restore_static_budget(m, lambda cfg: 256) and m.num_permuted_tokens == 777
    m = _hybridep_manager(moe_expert_rank_capacity_factor=None)  # megatron's dropless re-run
    assert not ps.restore_static_budget(m, lambda cfg: 256) and m.num_permuted_tokens is None


def test_hybridep_dispatch_wrapper_calls_through():
    seen = {}

    def dispatch(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        seen["budget"] = self.num_permuted_tokens
        return hidden_states

    wrapped = patches.get("paged_stash.hybridep_budget_on_graph_replay").factory(dispatch)
    m = _hybridep_manager()
    m.config.use_transformer_engine_op_fuser, m.config.fp8, m.config.fp4 = True, None, None
    assert wrapped(m, "h") == "h" and seen["budget"] == 12288


def test_overflow_report_lines():
    lines = []
    report = ps.OverflowReport(emit=lines.append)
    cfg = types.SimpleNamespace(moe_paged_stash_buffer_size_factor_cuda=0.05,
                                moe_paged_stash_buffer_size_factor_cpu=0.0,
                                moe_expert_rank_capacity_factor=1.5)
    report(0, 0, 0, config=cfg)
    assert lines == []
    report(2, 0, 0, config=cfg)
    assert "OVERFLOW" in lines[0] and "stash buffer full on 2 rank(s)" in lines[0]
    assert "re-runs the step" in lines[0] and "--moe-paged-stash-buffer-size-factor-cuda (now 0.05)" in lines[0]
    report(0, 0, 0, config=cfg)
    assert "re-run of this step finished without overflow (1 re-run(s) so far)" in lines[1]
    report(0, 1, 0, config=cfg)
    assert "receive budget exceeded" in lines[2] and "--moe-expert-rank-capacity-factor (now 1.5)" in lines[2]
    report(0, 0, 0, config=cfg)
    report(0, 0, 2, config=cfg)
    assert "pinned host memory on 2 rank(s)" in lines[-1] and report.reruns == 2


def test_overflow_report_ncclep_keeps_budget():
    lines = []
    report = ps.OverflowReport(emit=lines.append)
    cfg = types.SimpleNamespace(moe_paged_stash_buffer_size_factor_cuda=0.02, moe_paged_stash_buffer_size_factor_cpu=0.0,
                                moe_expert_rank_capacity_factor=2.0, moe_flex_dispatcher_backend="ncclep")
    report(1, 0, 0, config=cfg)
    assert "stash buffer full on 1 rank(s)" in lines[0]
    assert "with the same NCCL EP receive budget" in lines[0] and "without the receive budget" not in lines[0]


def test_overflow_patch_prints_on_rank0(capsys):
    class Runner:
        config = types.SimpleNamespace(moe_paged_stash_buffer_size_factor_cuda=0.05,
                                       moe_paged_stash_buffer_size_factor_cpu=0.0,
                                       moe_expert_rank_capacity_factor=1.5)

        def check(self):
            return (1, 0, 0)

    wrapped = patches.get("paged_stash.report_overflow").factory(Runner.check)
    assert wrapped(Runner()) == (1, 0, 0)
    out = capsys.readouterr().out
    assert out.startswith(f"{ps.LOG_PREFIX}: OVERFLOW")
    ps._REPORT.rerun_pending = False


def test_buffer_report(capsys):
    class Mgr:
        stash_buffers = None

        def allocate(self):
            return None

    wrapped = patches.get("paged_stash.report_buffers").factory(Mgr.allocate)
    wrapped(Mgr())
    assert "WARNING: no MoE activation was marked" in capsys.readouterr().out
    buf = types.SimpleNamespace(cuda_buffer=torch.zeros(128, 256, dtype=torch.bfloat16), host_buffer=None)
    Mgr.stash_buffers = {torch.bfloat16: {256: buf}}
    wrapped(Mgr())
    out = capsys.readouterr().out
    assert "bfloat16 width 256: 128 token rows, 0.1 MiB GPU" in out


# ---------------------------------------------------------------------------------------
# The launch script
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs", [{}, {"GRAPHS": "0", "STASH": "0"}, {"BACKEND": "hybridep"},
                                   {"BACKEND": "hybridep", "GRAPHS": "0", "STASH": "0"}])
def test_example_script_passes_dry_run(knobs):
    from tests.unit.conftest import dry_run_example

    # the script sets the CuTe-DSL variable itself
    proc = dry_run_example("examples/pretrain_moe_paged_stash.sh", drop=(ps.CUTEDSL_ENV,), **knobs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "expert model parallel (EP) ........ 2" in out and out.rstrip().endswith("dry-run: OK")
    assert "paged_stash.te_expert_ops" in out
    hybridep = knobs.get("BACKEND", "ncclep") == "hybridep"
    assert ("paged_stash.hybridep_budget_on_graph_replay" in out) == (hybridep and knobs.get("GRAPHS", "1") == "1")
    assert ("token_dispatcher.ncclep_bootstrap " in out) == (not hybridep)


# ---------------------------------------------------------------------------------------
# Result checks held back during a stashed attempt
# ---------------------------------------------------------------------------------------


class CheckingMachine:
    """Stands in for megatron's rerun state machine: records what validate_result was given."""

    def __init__(self):
        self.checked = []

    def validate_result(self, result, rejection_func, message, **kwargs):
        self.checked.append((result, message, rejection_func(result)))


def _runner(stashing=True):
    return types.SimpleNamespace(config=types.SimpleNamespace(moe_paged_stash=stashing))


def _attempt(machine, results):
    """A forward-backward that checks its loss and a gradient norm, as megatron's does."""

    def forward_backward(**kwargs):
        for message, value in results:
            machine.validate_result(value, math.isnan, message)
        return "losses"

    return forward_backward


def test_checks_of_a_clean_stashed_attempt_are_replayed_in_order():
    machine, runner = CheckingMachine(), _runner()
    deferred = ps.DeferredResultChecks(runner, _attempt(machine, [("loss", 2.5), ("grad norm", 1.0)]),
                                       lambda: machine, lambda r: (0, 0, 0))
    assert deferred(forward_only=False) == "losses"
    assert machine.checked == [(2.5, "loss", False), (1.0, "grad norm", False)]
    assert getattr(runner, ps.FLAGS_ATTR) == (0, 0, 0)
    assert "validate_result" not in vars(machine)  # the method is back


def test_checks_of_an_overflowed_attempt_are_dropped(capsys):
    machine, runner = CheckingMachine(), _runner()
    nan = float("nan")
    deferred = ps.DeferredResultChecks(runner, _attempt(machine, [("loss", 2.5), ("grad norm", nan)]),
                                       lambda: machine, lambda r: (1, 0, 0))
    deferred(forward_only=False)
    assert machine.checked == [] and deferred.dropped == 2
    assert "2 result check(s) of the overflowed attempt dropped" in capsys.readouterr().out
    # the re-run attempt (megatron turned paging off) is checked as it runs
    runner.config.moe_paged_stash = False
    deferred.forward_backward_func = _attempt(machine, [("grad norm", 3.0)])
    deferred(forward_only=False)
    assert machine.checked == [(3.0, "grad norm", False)]


def test_held_checks_neither_keep_the_graph_alive_nor_see_later_in_place_changes():
    """megatron checks a loss that is still attached to its graph, then scales it in place; the
    held check keeps a detached copy (holding the loss kept every micro-batch's autograd graph,
    and the buffers its op contexts reference, allocated until the step ended)."""
    import weakref

    machine, runner = CheckingMachine(), _runner()
    seen = {}

    class KeepsBuffer(torch.autograd.Function):
        """An op whose context keeps a tensor that backward does not free (as the TE ops do)."""

        @staticmethod
        def forward(ctx, x):
            ctx.buffer = torch.zeros(4)
            return x * 2.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    def forward_backward(**kwargs):
        w = torch.ones(3, requires_grad=True)
        loss = KeepsBuffer.apply(w).sum()
        machine.validate_result(loss, lambda r: bool(torch.isnan(r)), "loss")
        graph = weakref.ref(loss.grad_fn.next_functions[0][0].buffer)
        loss.backward()
        loss.detach().div_(4.0)  # the schedule's in-place scaling after the check
        del loss
        seen["graph_alive"] = graph() is not None
        return "losses"

    deferred = ps.DeferredResultChecks(runner, forward_backward, lambda: machine, lambda r: (0, 0, 0))
    deferred(forward_only=False)
    assert seen["graph_alive"] is False
    (value, message, rejected), = machine.checked
    assert value.item() == 6.0 and value.grad_fn is None and message == "loss" and rejected is False


def test_slack_path_leaves_no_gradient_buffer_on_the_op_context():
    weights, x, sizes, grad = make_case()
    op = PagedGL(weights)
    x = x.clone().requires_grad_(True)
    out = _FuserFunction.apply(x, op, torch.tensor(sizes))
    graph = out.grad_fn
    out.backward(grad)
    # The context outlives the backward as long as the graph does: the dgrad view must be gone.
    assert graph.opctx.dgrad_out is None
    assert x.grad.shape == x.shape


def test_method_is_restored_when_the_attempt_raises():
    machine, runner = CheckingMachine(), _runner()

    def broken(**kwargs):
        raise RuntimeError("boom")

    deferred = ps.DeferredResultChecks(runner, broken, lambda: machine, lambda r: (0, 0, 0))
    with pytest.raises(RuntimeError, match="boom"):
        deferred()
    assert "validate_result" not in vars(machine)


def test_megatron_rerun_state_machine_can_be_deferred():
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    machine = RerunStateMachine(mode=RerunMode.DISABLED)
    runner = _runner()
    deferred = ps.DeferredResultChecks(runner, _attempt(machine, [("loss", 1.0)]), lambda: machine,
                                       lambda r: (0, 0, 0))
    deferred()  # the finite loss passes megatron's own check on replay
    assert machine.validate_result.__func__ is RerunStateMachine.validate_result


def test_report_uses_the_flags_the_deferral_already_reduced(capsys):
    calls = []

    class Runner:
        config = None

        def check(self):
            calls.append(1)
            return (0, 0, 0)

    wrapped = patches.get("paged_stash.report_overflow").factory(Runner.check)
    runner = Runner()
    setattr(runner, ps.FLAGS_ATTR, (0, 0, 1))
    assert wrapped(runner) == (0, 0, 1) and calls == []  # no second all-reduce
    assert wrapped(runner) == (0, 0, 0) and calls == [1]  # consumed once
    assert "spilled activations" in capsys.readouterr().out


def test_upstream_check_flags_skips_the_report_wrapper():
    class Runner:
        def check_moe_overflow(self):
            return (1, 0, 0)

    Runner.check_moe_overflow = patches.get("paged_stash.report_overflow").factory(Runner.check_moe_overflow)
    ps._REPORT.rerun_pending = False
    assert ps._upstream_check_flags(Runner()) == (1, 0, 0)  # megatron's flags, as they are
    assert ps._REPORT.rerun_pending is False  # the report wrapper did not run (it would flag a re-run)


class FakeTracker:
    """megatron's RNG tracker interface: named states, tensors or (graph-safe) Generators."""

    def __init__(self):
        gen = torch.Generator()
        gen.manual_seed(7)
        self.states_ = {"model-parallel-rng": gen, "data-parallel-rng": torch.tensor([1, 2, 3], dtype=torch.uint8)}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states


def _drawing_attempt(tracker, draws):
    """A forward-backward with dropout: draws from every stream the step uses."""
    import random

    def forward_backward(**kwargs):
        gen = tracker.states_["model-parallel-rng"]
        draws.append((random.random(), torch.rand(1).item(), torch.rand(1, generator=gen).item()))
        tracker.states_["data-parallel-rng"] = tracker.states_["data-parallel-rng"] + 1  # advanced in place
        return "losses"

    return forward_backward


@pytest.mark.parametrize("overflowed", [True, False])
def test_an_overflowed_attempts_random_draws_are_undone(overflowed):
    """After an overflowed attempt the re-run draws the same numbers again (as a step that never
    paged); after a clean attempt the streams go on."""
    tracker, draws = FakeTracker(), []
    machine, runner = CheckingMachine(), _runner()
    generator = tracker.states_["model-parallel-rng"]
    deferred = ps.DeferredResultChecks(runner, _drawing_attempt(tracker, draws), lambda: machine,
                                       lambda r: (int(overflowed), 0, 0),
                                       rng=ps.RngStates(tracker=lambda: tracker, cuda=False))
    deferred(forward_only=False)
    runner.config.moe_paged_stash = False  # megatron's re-run (or, clean, the next step) pages no more
    deferred(forward_only=False)
    assert (draws[1] == draws[0]) is overflowed
    assert tracker.states_["model-parallel-rng"] is generator  # set in place: a graph keeps its generator
    assert tracker.states_["data-parallel-rng"].tolist() == ([2, 3, 4] if overflowed else [3, 4, 5])
