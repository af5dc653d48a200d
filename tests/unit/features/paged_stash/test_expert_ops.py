"""The TE op-fuser expert ops on CPU tensors: slack rows of a static expert buffer (zero output,
zero input gradient), and the saved input megatron's real paged-stash hook pages."""

import types

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.paged_stash import budget, expert_ops


class FakeTEGroupedLinear:
    """TE 2.20.2 ops.GroupedLinear's split path, reduced to bf16-free plain matmuls."""

    def __init__(self, weights):
        self.weights = weights
        self.weight0 = weights[0]
        self.num_groups = len(weights)
        self.out_features, self.in_features = weights[0].shape
        self._scale_bias = False
        self.single_grouped_weight = False

    def _fuser_forward_split_quantize(
        self, *, input_, split_sizes, scales, dtype, device, out_buffer=None, **_
    ):
        sizes = [int(s) for s in split_sizes.tolist()]
        xs = torch.split(input_, sizes)  # raises unless the sizes cover every row, as in TE
        out = (
            torch.empty((input_.shape[0], self.out_features), dtype=dtype)
            if out_buffer is None
            else out_buffer
        )
        assert tuple(out.shape) == (input_.shape[0], self.out_features), (
            "TE validate_or_alloc_output"
        )
        out.copy_(torch.cat([x @ w.t() for x, w in zip(xs, self.weights)]))
        return out, (split_sizes, None, None, None, None, *xs, *self.weights)

    def fuser_forward_save_ctx(
        self, basic_op_ctxs, input_, tensors_to_save, *, requires_grad, use_grouped_tensor_path, **_
    ):
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
        dx = (
            torch.empty((rows, self.in_features), dtype=ctx.dtype)
            if ctx.dgrad_out is None
            else ctx.dgrad_out
        )
        assert tuple(dx.shape) == (rows, self.in_features)
        dx.copy_(torch.cat([dy @ w for dy, w in zip(dys, ws)]))
        dws = [dy.t() @ x for dy, x in zip(dys, xs)]
        return dx, [dws], [(None,)]


class FakeTEScaledSwiGLU:
    def fuser_forward(self, basic_op_ctxs, input_, **_):
        basic_op_ctxs[0].to_save = (input_,)
        return input_ * 2, [()]


PagedGL = expert_ops.make_grouped_linear(FakeTEGroupedLinear)


PagedSwiGLU = expert_ops.make_scaled_glu(FakeTEScaledSwiGLU)


class _FuserFunction(torch.autograd.Function):
    """Like TE's fuser: run the op's forward, save its to_save list through autograd."""

    @staticmethod
    def forward(func_ctx, x, op, split_sizes):
        ctx = types.SimpleNamespace(requires_grad=True)
        out, saved = op._fuser_forward_split_quantize(
            input_=x, split_sizes=split_sizes, scales=None, dtype=x.dtype, device=x.device
        )
        op.fuser_forward_save_ctx(
            [ctx], x, [saved], requires_grad=[True], use_grouped_tensor_path=False
        )
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
    x[sum(sizes) :] = float("nan")  # slack rows of a static buffer hold anything
    grad = torch.randn(rows, out, generator=g, dtype=torch.float64)
    return weights, x, list(sizes), grad


def reference(weights, x, sizes, grad):
    total = sum(sizes)
    xs, gs = torch.split(x[:total], sizes), torch.split(grad[:total], sizes)
    out = torch.cat([a @ w.t() for a, w in zip(xs, weights)])
    dx = torch.cat([g @ w for g, w in zip(gs, weights)])
    return out, dx


def test_megatron_expert_ops_are_adopted():
    """The patch re-classes the ops megatron's _make_fused_ops built (TE classes passed in)."""
    weights = make_case()[0]
    other = torch.nn.Identity()
    ops = [FakeTEGroupedLinear(weights), FakeTEScaledSwiGLU(), FakeTEGroupedLinear(weights), other]
    assert expert_ops.adopt_ops(ops, FakeTEGroupedLinear, FakeTEScaledSwiGLU) == 3
    assert [type(o).__name__ for o in ops] == [
        "PagedStashGroupedLinear",
        "PagedStashScaledSwiGLU",
        "PagedStashGroupedLinear",
        "Identity",
    ]
    assert type(ops[0]) is type(ops[2]) and isinstance(ops[0], FakeTEGroupedLinear)
    assert expert_ops.adopt_ops(ops, FakeTEGroupedLinear, FakeTEScaledSwiGLU) == 0  # idempotent
    _, x, sizes, grad = make_case()
    out, _ = run(ops[0], x, sizes, grad)  # slack rows now work
    assert torch.count_nonzero(out[sum(sizes) :]) == 0

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
    saved = {
        k: sys.modules.get(k)
        for k in (
            "transformer_engine",
            "transformer_engine.pytorch",
            "transformer_engine.pytorch.ops",
            "transformer_engine.pytorch.ops.basic",
            "transformer_engine.pytorch.ops.basic.grouped_linear",
        )
    }
    try:
        for k in saved:
            sys.modules[k] = types.ModuleType(k)
        sys.modules["transformer_engine.pytorch.ops"] = te_ops
        sys.modules["transformer_engine.pytorch.ops.basic.grouped_linear"] = te_gl
        wrapped = registry.get("paged_stash.te_expert_ops").factory(make_fused_ops)
        built = wrapped(Fused())
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    assert [type(o).__name__ for o in built] == [
        "PagedStashGroupedLinear",
        "PagedStashScaledSwiGLU",
    ]


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
    with pytest.raises(expert_ops.SlackRowError, match="7 tokens .* only 5 rows"):
        expert_ops.slack_rows([3, 4], 5)
    assert expert_ops.slack_rows([3, 4], 9) == 2


def test_helpers():
    assert budget.rank_budget(4096, 2, 1.5, 256) == 12288
    assert budget.rank_budget(1000, 8, 1.1, 256) == 8960  # 8800 rounded up to 256
    assert budget.rank_budget(1000, 8, 1.1, None) == 8800
    padded = expert_ops.pad_rows(torch.ones(2, 3), 4)
    assert padded.shape == (4, 3) and padded[2:].abs().sum() == 0 and padded[:2].sum() == 6


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
    return torch.autograd.graph.saved_tensors_hooks(
        mgr.on_save_for_backward, mgr.on_get_saved_tensor
    )


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
    assert expert_ops.stash_expects(t)
    manager.max_num_tokens = 10
    assert not expert_ops.stash_expects(t)
    manager.enabled = False
    manager.max_num_tokens = 12
    assert not expert_ops.stash_expects(t)


def test_swiglu_marks_its_saved_input(manager):
    manager.max_num_tokens = 12
    op, ctx = PagedSwiGLU(), types.SimpleNamespace(requires_grad=True)
    x = torch.zeros(12, 8)
    op.fuser_forward([ctx], x)
    assert getattr(ctx.to_save[0], expert_ops.STASH_MARK) is False
    y = torch.zeros(9, 8)
    op.fuser_forward([ctx], y)
    assert not hasattr(y, expert_ops.STASH_MARK)


def test_mark_for_stash_grouped_storage():
    data = torch.zeros(4, 2)
    storage = types.SimpleNamespace(rowwise_data=data, columnwise_data=None)
    assert expert_ops.mark_for_stash(storage) and getattr(data, expert_ops.STASH_MARK) is False
    quantized = types.SimpleNamespace(rowwise_data=torch.zeros(1), columnwise_data=torch.zeros(1))
    assert not expert_ops.mark_for_stash(quantized) and not hasattr(
        quantized.columnwise_data, expert_ops.STASH_MARK
    )
    assert not expert_ops.mark_for_stash(None)


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
