"""--moe-grouped-gemm-impl torch: the grouped GEMMs against per-expert matmuls, the main_grad
contract with megatron's DDP, CUDA-graph capture, and the linears' rebinding in TE's spec
provider."""

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.core.registry import PatchsetError
from megatron.patchset.features.grouped_mm import linears
from megatron.patchset.features.grouped_mm import torch_grouped_gemm as tgg
from tests.unit.features.grouped_mm.conftest import (
    IN,
    OUT,
    SPLITS,
    FakeTEGroupedLinear,
    ddp_main_grads,
    expert_weights,
    grouped_mlp,
    rows,
    tiny_parsed,
)


def reference(x, splits, weights, dy):
    """Per-expert fp32 matmuls: output, input gradient, weight gradients."""
    outs, dxs, dws, start = [], [], [], 0
    for n, w in zip(splits, weights):
        xe, dye, we = (
            x[start : start + n].float(),
            dy[start : start + n].float(),
            w.detach().float(),
        )
        outs.append(xe @ we.t())
        dxs.append(dye @ we)
        dws.append(dye.t() @ xe)
        start += n
    return torch.cat(outs), torch.cat(dxs), dws


def close(a, b):
    """Equal within bf16 rounding: 1% of the reference's largest magnitude."""
    b = b.float()
    torch.testing.assert_close(a.float(), b, atol=0.01 * b.abs().max().item() + 1e-6, rtol=0)


def test_offsets_are_cumulative_int32_and_shared_by_equal_splits():
    offs = linears.group_offsets(SPLITS, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 5, 8, 8, 17, 18, 18]
    assert linears.group_offsets(list(SPLITS), torch.device("cpu")) is offs  # fc2 reuses fc1's
    assert linears.group_offsets([1] * 7, torch.device("cpu")) is not offs
    as_tensor = linears.group_offsets(torch.tensor(SPLITS), torch.device("cpu"))
    assert as_tensor.dtype == torch.int32 and as_tensor.tolist() == offs.tolist()


def test_forward_and_gradients_match_per_expert_matmuls():
    weights = expert_weights()
    m = sum(SPLITS)
    x = rows(m).requires_grad_(True)
    dy = rows(m, OUT, seed=2)
    out = linears.grouped_mm(x, SPLITS, weights)
    out.backward(dy)
    ref_out, ref_dx, ref_dws = reference(x.detach(), SPLITS, weights, dy)
    assert out.shape == (m, OUT) and out.dtype == torch.bfloat16
    close(out, ref_out)
    close(x.grad, ref_dx)
    for n, w, ref_dw in zip(SPLITS, weights, ref_dws):
        assert w.grad.shape == w.shape
        close(w.grad, ref_dw)
        if n == 0:
            assert torch.count_nonzero(w.grad) == 0


def test_an_expanded_output_gradient_is_accepted():
    # out.sum().backward() hands grouped_mm a stride-0 gradient, which its kernels refuse.
    weights = expert_weights()
    x = rows(sum(SPLITS)).requires_grad_(True)
    linears.grouped_mm(x, SPLITS, weights).sum().backward()
    _, ref_dx, _ = reference(x.detach(), SPLITS, weights, torch.ones(sum(SPLITS), OUT))
    close(x.grad, ref_dx)


def ddp_managed(weights, prior=0.5, **attrs):
    """What megatron's DDP puts on a parameter: an fp32 main_grad and grad_added_to_main_grad."""
    for w in weights:
        w.main_grad = torch.full(w.shape, prior, dtype=torch.float32)
        w.grad_added_to_main_grad = False
        for key, value in attrs.items():
            setattr(w, key, value)
    return weights


def test_ddp_managed_weights_accumulate_into_main_grad():
    weights = ddp_managed(expert_weights())
    x = rows(sum(SPLITS))
    dy = rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    _, _, ref_dws = reference(x, SPLITS, weights, dy)
    for w, ref_dw in zip(weights, ref_dws):
        close(w.main_grad, ref_dw + 0.5)
        assert w.grad_added_to_main_grad is True
        # DDP's hook sees a gradient (so it fires) and, with the flag set, does not add it again.
        assert w.grad is not None and w.grad.shape == w.shape
    # AccumulateGrad kept the dummy instead of copying it: one buffer behind all the gradients.
    assert len({w.grad.untyped_storage().data_ptr() for w in weights}) == 1


def test_fp32_weight_gradients_only_where_the_device_writes_them():
    # PyTorch's CPU fallback refuses out_dtype=float32 (CUDA on sm90 accepts it): bf16 then.
    assert tgg._wgrad_out_dtype(torch.float32, torch.device("cpu")) is None
    assert tgg._fp32_wgrad_supported == {"cpu": False}
    assert tgg._wgrad_out_dtype(torch.bfloat16, torch.device("cpu")) is None


def test_overwrite_main_grad_and_zero_out_wgrad():
    weights = ddp_managed(expert_weights(), overwrite_main_grad=True, zero_out_wgrad=True)
    x = rows(sum(SPLITS))
    dy = rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    _, _, ref_dws = reference(x, SPLITS, weights, dy)
    for w, ref_dw in zip(weights, ref_dws):
        close(w.main_grad, ref_dw)  # the prior 0.5 is gone
        # With zero_out_wgrad DDP adds param.grad anyway: it must be zeros.
        assert torch.count_nonzero(w.grad) == 0


def test_no_rows_leaves_main_grad_and_still_hands_ddp_a_gradient():
    weights = ddp_managed(expert_weights())
    x = rows(0).requires_grad_(True)
    out = linears.grouped_mm(x, [0] * len(weights), weights, fuse_accumulation=True)
    assert out.shape == (0, OUT)
    out.backward(torch.empty(0, OUT, dtype=torch.bfloat16))
    assert x.grad.shape == (0, IN)
    for w in weights:
        assert torch.equal(w.main_grad, torch.full(w.shape, 0.5))
        assert w.grad_added_to_main_grad is True and w.grad is not None


def test_missing_main_grad_is_a_clear_error():
    weights = expert_weights()
    for w in weights:
        w.grad_added_to_main_grad = False
    with pytest.raises(RuntimeError, match="no main_grad"):
        linears.grouped_mm(
            rows(sum(SPLITS)), SPLITS, weights, fuse_accumulation=True
        ).sum().backward()


def test_linear_subclass_runs_the_grouped_gemm_on_its_own_weights(capsys, monkeypatch):
    monkeypatch.setattr(linears, "_announced", set())
    cls = linears.grouped_mm_linear(FakeTEGroupedLinear, "Column")
    assert (
        issubclass(cls, FakeTEGroupedLinear)
        and cls.__name__ == "GroupedMMColumnParallelGroupedLinear"
    )
    linear = cls(len(SPLITS), IN, OUT)
    cls(len(SPLITS), IN, OUT)
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("megatron-patchset: experts'")
    ]
    assert lines == [
        "megatron-patchset: experts' GroupedMMColumnParallelGroupedLinear runs forward, dgrad and "
        f"wgrad as one torch grouped_mm each ({len(SPLITS)} local experts, {IN} -> {OUT} before "
        "tensor parallelism)"
    ]
    x = rows(sum(SPLITS))
    out, bias = linear(x, SPLITS)
    assert bias is None and linear.is_first_microbatch is False
    weights = [getattr(linear, f"weight{i}") for i in range(len(SPLITS))]
    close(out, reference(x, SPLITS, weights, torch.zeros(sum(SPLITS), OUT))[0])
    out.sum().backward()
    assert all(w.grad is not None for w in weights)  # no DDP attributes: plain gradients
    with pytest.raises(RuntimeError, match="bf16"):
        linear(x.float(), SPLITS)


def test_megatrons_te_grouped_mlp_runs_on_the_grouped_gemm_linears():
    """TEGroupedMLP's own forward (token counts to a list, fc1, SwiGLU times the router
    probabilities, fc2) on the patched linears equals per-expert SwiGLU MLPs."""
    import torch.nn.functional as F

    hidden, splits = IN, [3, 0, 6, 2]
    mlp = grouped_mlp(splits)
    x = rows(sum(splits), hidden).requires_grad_(True)
    probs = torch.rand(sum(splits), generator=torch.Generator().manual_seed(3))
    out, bias = mlp(x, torch.tensor(splits), probs)
    assert bias is None and out.shape == (sum(splits), hidden)

    expected, start = [], 0
    for e, n in enumerate(splits):
        w1, w2 = (
            getattr(mlp.linear_fc1, f"weight{e}").float(),
            getattr(mlp.linear_fc2, f"weight{e}").float(),
        )
        gate, up = torch.chunk(x[start : start + n].detach().float() @ w1.t(), 2, dim=-1)
        expected.append((F.silu(gate) * up * probs[start : start + n, None]) @ w2.t())
        start += n
    close(out, torch.cat(expected))
    out.float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert torch.count_nonzero(mlp.linear_fc1.weight1.grad) == 0  # the expert without tokens
    assert torch.count_nonzero(mlp.linear_fc2.weight2.grad) > 0


def test_without_transformer_engine_the_patch_names_it():
    with pytest.raises(PatchsetError, match="TransformerEngine is not installed"):
        linears.grouped_mm_linear(None, "Row")


def test_patches_rebind_the_names_te_spec_provider_builds_experts_from(monkeypatch):
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    # No TE on the CPU: stand-ins take the place of megatron's TE grouped linears.
    column = type("TEColumnParallelGroupedLinear", (FakeTEGroupedLinear,), {})
    row = type("TERowParallelGroupedLinear", (FakeTEGroupedLinear,), {})
    monkeypatch.setattr(provider, "TEColumnParallelGroupedLinear", column)
    monkeypatch.setattr(provider, "TERowParallelGroupedLinear", row)
    names = ["grouped_mm.fc1", "grouped_mm.fc2"]
    assert all(
        registry.get(n).wanted(tiny_parsed("--moe-grouped-gemm-impl", "torch")) for n in names
    )
    assert not any(registry.get(n).wanted(tiny_parsed()) for n in names)
    try:
        assert registry.apply_patches([registry.get(n) for n in names]) == names
        spec = provider.TESpecProvider().grouped_mlp_modules(True)
        assert spec.func is TEGroupedMLP
        fc1, fc2 = spec.keywords["submodules"].linear_fc1, spec.keywords["submodules"].linear_fc2
        assert issubclass(fc1, column) and issubclass(fc1, linears.GroupedMMForward)
        assert issubclass(fc2, row) and issubclass(fc2, linears.GroupedMMForward)
        assert registry.patched_by(fc1) == "grouped_mm.fc1"
    finally:
        registry.revert(names)
    assert (
        provider.TEColumnParallelGroupedLinear is column
        and provider.TERowParallelGroupedLinear is row
    )


@pytest.mark.parametrize("descending", [False, True])
def test_main_grads_back_to_back_take_one_add(descending, monkeypatch):
    """DDP's buffer holds a layer's expert main grads back to back (in reverse order): the weight
    gradient goes in with one add over a view of them, not a foreach over the experts."""
    weights = expert_weights()
    buffer = ddp_main_grads(weights, descending)
    view, flipped = tgg.stacked_view([w.main_grad for w in weights])
    assert flipped is descending and view.data_ptr() == buffer.data_ptr()

    def refuse(*args, **kwargs):
        raise AssertionError("foreach path taken")

    monkeypatch.setattr(torch, "_foreach_add_", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_scattered_main_grads_take_the_foreach_path_in_one_dtype(monkeypatch):
    weights = ddp_managed(expert_weights())  # separate fp32 tensors
    assert tgg.stacked_view([w.main_grad for w in weights]) is None
    seen = []
    add = torch._foreach_add_

    def record(selves, others):
        seen.append({t.dtype for t in others})
        return add(selves, others)

    monkeypatch.setattr(torch, "_foreach_add_", record)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    assert seen == [{torch.float32}]  # bf16 gradients cast once, so the multi-tensor kernel applies
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_stacked_view_refuses_gaps_and_mixed_shapes():
    buffer = torch.zeros(5, 2, 3)
    assert tgg.stacked_view([buffer[0], buffer[1], buffer[3]]) is None
    assert tgg.stacked_view([buffer[0], buffer[1, :1]]) is None
    assert tgg.stacked_view([buffer[0], torch.zeros(2, 3)]) is None
    view, descending = tgg.stacked_view([buffer[2]])
    assert view.shape == (1, 2, 3) and not descending


def test_inside_a_graph_capture_the_reversed_copy_is_skipped(monkeypatch):
    """While a CUDA graph is captured, launches are free at replay: the main grads lying in reverse
    order take one add per expert instead of a reversed copy of the weight gradients plus one
    add."""
    weights = expert_weights()
    ddp_main_grads(weights)
    tgg._wgrad_out_dtype(torch.float32, torch.device("cpu"))  # the probe runs before any capture
    monkeypatch.setattr(tgg, "capturing", lambda device: True)

    def refuse(*args, **kwargs):
        raise AssertionError("reversed copy made")

    monkeypatch.setattr(torch.Tensor, "flip", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_the_fp32_probe_refuses_to_run_inside_a_capture(monkeypatch):
    monkeypatch.setattr(tgg, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="--cuda-graph-warmup-steps 1 or more"):
        tgg._wgrad_out_dtype(torch.float32, torch.device("cpu"))
    assert tgg._fp32_wgrad_supported == {}


def test_padded_device_splits_keep_the_rows_after_the_last_expert_zero(monkeypatch):
    """The static dispatch's buffers have rows after the last expert's: grouped_mm leaves them
    unwritten (here: NaN, as uninitialised memory may hold), the linear writes zeros there
    (forward and data gradient), and the expert rows and weight gradients are those of the
    unpadded input."""
    import torch.nn.functional as F

    grouped = F.grouped_mm

    def unwritten_tail(a, b, *args, offs=None, **kwargs):
        out = grouped(a, b, *args, offs=offs, **kwargs)
        if a.dim() == 2 and b.dim() == 3:
            out[int(offs[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(F, "grouped_mm", unwritten_tail)
    weights = expert_weights()
    total, pad = sum(SPLITS), 6
    x = rows(total)
    dy = rows(total, OUT, seed=4)
    y = linears.grouped_mm(x.requires_grad_(True), torch.tensor(SPLITS), weights)
    y.backward(dy)
    expected = (y.detach(), x.grad, [w.grad.clone() for w in weights])
    for w in weights:
        w.grad = None
    padded_x = torch.cat([x.detach(), torch.zeros(pad, IN, dtype=x.dtype)]).requires_grad_(True)
    splits = linears.DeviceSplits(torch.tensor(SPLITS), padded=True)
    out = linears.grouped_mm(padded_x, splits, weights)
    out.backward(torch.cat([dy, torch.zeros(pad, OUT, dtype=dy.dtype)]))
    assert torch.equal(out[:total], expected[0]) and out[total:].eq(0).all()
    assert torch.equal(padded_x.grad[:total], expected[1]) and padded_x.grad[total:].eq(0).all()
    for w, g in zip(weights, expected[2]):
        assert torch.equal(w.grad, g)
    assert "padded" in repr(splits)


@pytest.mark.parametrize("descending", [False, True])
def test_gradients_in_the_main_grads_dtype_take_one_foreach_in_reverse(descending, monkeypatch):
    """A weight gradient already in the main grads' dtype (fp32 from the GEMM on the GPU; bf16 here)
    goes in with one multi-tensor add when DDP's buffer holds the main grads in reverse order --
    no reversed copy, no add per expert, captured or not -- and with one add over the view when
    they lie in order."""
    weights = expert_weights()
    ddp_main_grads(weights, descending, dtype=torch.bfloat16)
    monkeypatch.setattr(tgg, "capturing", lambda device: True)
    seen, adds = [], []
    add, tensor_add = torch._foreach_add_, torch.Tensor.add_

    def record(selves, others):
        seen.append((len(selves), {t.dtype for t in others}))
        return add(selves, others)

    def count(self, *args, **kwargs):
        adds.append(tuple(self.shape))
        return tensor_add(self, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("reversed copy made")

    monkeypatch.setattr(torch, "_foreach_add_", record)
    monkeypatch.setattr(torch.Tensor, "add_", count)
    monkeypatch.setattr(torch.Tensor, "flip", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    linears.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    if descending:
        assert seen == [(len(weights), {torch.bfloat16})] and adds == []
    else:
        assert seen == [] and adds == [(len(weights), OUT, IN)]
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_the_first_forward_puts_the_weights_in_one_storage_and_the_gemms_stack_nothing(monkeypatch):
    """The linear's expert weights become rows of one (experts, out, in) tensor at its first
    forward, with their values; from then on forward and backward read that tensor as it is (no
    torch.stack), and the results stay the per-expert matmuls'."""
    cls = linears.grouped_mm_linear(FakeTEGroupedLinear, "Row")
    linear = cls(len(SPLITS), IN, OUT)
    weights = [getattr(linear, f"weight{i}") for i in range(len(SPLITS))]
    values = [w.detach().clone() for w in weights]
    stacks = []
    stack = torch.stack

    def record(*args, **kwargs):
        stacks.append(len(args[0]))
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", record)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    for _ in range(2):
        for w in weights:
            w.grad = None
        x.requires_grad_(True)
        out, _ = linear(x, SPLITS)
        out.backward(dy)
        ref_out, ref_dx, ref_dws = reference(x.detach(), SPLITS, weights, dy)
        close(out, ref_out)
        close(x.grad, ref_dx)
        for w, ref_dw in zip(weights, ref_dws):
            close(w.grad, ref_dw)
        x = x.detach()
    assert stacks == []
    storage = weights[0].untyped_storage()
    assert storage.nbytes() == len(SPLITS) * OUT * IN * 2
    for i, (w, v) in enumerate(zip(weights, values)):
        assert isinstance(w, torch.nn.Parameter) and torch.equal(w, v)
        assert w.untyped_storage().data_ptr() == storage.data_ptr()
        assert w.storage_offset() == i * OUT * IN
    view = tgg.expert_stack(weights)
    assert view.shape == (len(SPLITS), OUT, IN) and view.data_ptr() == storage.data_ptr()


def test_weights_that_are_views_already_stay_and_are_stacked_per_gemm(monkeypatch):
    """Under --use-distributed-optimizer the weights are views of DDP's parameter buffer, in
    reverse order: they are not moved, and each GEMM stacks a copy."""
    buffer = torch.stack(expert_weights()).detach()
    weights = [torch.nn.Parameter(expert_weights()[0]) for _ in range(len(buffer))]
    for i, w in enumerate(weights):  # how DDP points them into its buffer
        w.data = buffer[len(buffer) - 1 - i]
    assert not tgg.share_one_storage(weights)
    assert all(w.untyped_storage().data_ptr() == buffer.data_ptr() for w in weights)
    assert [w.storage_offset() for w in weights] == [
        (len(buffer) - 1 - i) * OUT * IN for i in range(len(buffer))
    ]
    stacked = tgg.expert_stack(weights)
    assert stacked.data_ptr() != buffer.data_ptr()
    assert all(torch.equal(stacked[i], w) for i, w in enumerate(weights))
    mixed = expert_weights()[:2] + [torch.zeros(OUT + 1, IN, dtype=torch.bfloat16)]
    assert not tgg.share_one_storage(mixed)


def _in_ddp_buffers(values):
    """Expert weights and fp32 main grads as megatron's DDP holds them under the distributed
    optimizer: views of one parameter buffer and one gradient buffer, expert ``e`` at index
    ``n - 1 - e`` of both."""
    n = len(values)
    params = torch.stack(values[::-1]).detach()
    weights = [torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16)) for _ in range(n)]
    for i, w in enumerate(weights):
        w.data = params[n - 1 - i]
    ddp_main_grads(weights, descending=True)
    return weights


def test_descending_row_groups_read_the_weights_in_place_with_the_same_bits(monkeypatch):
    """Rows grouped from the last expert to the first (the static dispatch's layout for weights in
    DDP's buffers): no stacked copy of the weights in forward or backward, the weight gradients go
    into the main grads with one add in expert order, and every output row, data gradient and
    main grad equals that of the expert-order layout to the bit."""
    values = [w.detach() for w in expert_weights()]
    splits = torch.tensor(SPLITS)
    total, n = sum(SPLITS), len(SPLITS)
    x, dy = rows(total), rows(total, OUT, seed=2)
    starts = [sum(SPLITS[:e]) for e in range(n)]
    backwards = [i for e in reversed(range(n)) for i in range(starts[e], starts[e] + SPLITS[e])]

    upward, downward = _in_ddp_buffers(values), _in_ddp_buffers(values)
    stacks, adds = [], []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or stack(*a, **k))

    def one_add(view, dw, overwrite=False, descending=True):  # the Triton kernel's arithmetic
        adds.append(descending)
        view.add_(dw.flip(0) if descending else dw)

    monkeypatch.setattr(tgg, "add_reversed_available", lambda device: True)
    monkeypatch.setattr(tgg, "add_reversed", one_add)
    x_up = x.clone().requires_grad_(True)
    y_up = linears.grouped_mm(x_up, linears.DeviceSplits(splits), upward, fuse_accumulation=True)
    y_up.backward(dy)
    # expert order: a stacked copy for forward and for dgrad, the add into the reversed stack
    assert len(stacks) == 2 and adds == [True]

    stacks.clear()
    adds.clear()
    x_down = x[backwards].clone().requires_grad_(True)
    down_splits = linears.DeviceSplits(splits.flip(0), descending=True)
    y_down = linears.grouped_mm(x_down, down_splits, downward, fuse_accumulation=True)
    y_down.backward(dy[backwards])

    assert stacks == [] and adds == [False]
    assert torch.equal(y_down, y_up[backwards])
    assert torch.equal(x_down.grad, x_up.grad[backwards])
    for up, down in zip(upward, downward):
        assert torch.equal(down.main_grad, up.main_grad) and down.grad_added_to_main_grad
    assert list(down_splits) == SPLITS  # megatron's token log reads them in expert order
    assert "descending" in repr(down_splits)


@pytest.mark.parametrize("padded", [False, True])
def test_the_linear_module_takes_descending_splits_padded_or_not(padded):
    """The linear's forward reads ``descending`` from its device splits, with or without padding
    rows: rows grouped from the last expert to the first give each row its own expert's output."""
    cls = linears.grouped_mm_linear(FakeTEGroupedLinear, "Row")
    linear = cls(len(SPLITS), IN, OUT)
    weights = [getattr(linear, f"weight{i}") for i in range(len(SPLITS))]
    total = sum(SPLITS)
    starts = [sum(SPLITS[:e]) for e in range(len(SPLITS))]
    backwards = [
        i for e in reversed(range(len(SPLITS))) for i in range(starts[e], starts[e] + SPLITS[e])
    ]
    x = rows(total)
    expected = reference(x, SPLITS, weights, rows(total, OUT))[0]
    splits = linears.DeviceSplits(torch.tensor(SPLITS[::-1]), padded=padded, descending=True)
    out, _ = linear(x[backwards], splits)
    close(out, expected[backwards])
