"""--moe-grouped-gemm-impl torch on the CPU: the grouped GEMMs against per-expert matmuls, the
main_grad contract with megatron's DDP, the linears' rebinding in TE's spec provider, the rules.

PyTorch's grouped_mm has a CPU fallback for bf16 (the same operator and layouts as on the GPU), so
the arithmetic, the offsets and the gradient plumbing are checked here; tests/gpu/test_grouped_mm.py
compares with TransformerEngine's GroupedLinear and trains with it."""

import pytest
import torch

from megatron.patchset import experts, patches
from megatron.patchset.patches import PatchsetError
from tests.unit.test_rules import failures
from tests.unit.conftest import tiny_argv

IN, OUT = 32, 16
# Row counts per expert, with empty experts at the start, in the middle and at the end.
SPLITS = [0, 5, 3, 0, 9, 1, 0]


def expert_weights(n=len(SPLITS), requires_grad=True, seed=0, shape=(OUT, IN)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_(requires_grad) for _ in range(n)]


def rows(m, width=IN, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen).to(torch.bfloat16)


def reference(x, splits, weights, dy):
    """Per-expert fp32 matmuls: output, input gradient, weight gradients."""
    outs, dxs, dws, start = [], [], [], 0
    for n, w in zip(splits, weights):
        xe, dye, we = x[start:start + n].float(), dy[start:start + n].float(), w.detach().float()
        outs.append(xe @ we.t())
        dxs.append(dye @ we)
        dws.append(dye.t() @ xe)
        start += n
    return torch.cat(outs), torch.cat(dxs), dws


def close(a, b):
    """Equal within bf16 rounding: 1% of the reference's largest magnitude."""
    b = b.float()
    torch.testing.assert_close(a.float(), b, atol=0.01 * b.abs().max().item() + 1e-6, rtol=0)


@pytest.fixture(autouse=True)
def fresh_caches():
    for cache in (experts._offsets_cache, experts._fp32_wgrad_supported):
        cache.clear()
    yield
    experts._offsets_cache.clear()


def test_offsets_are_cumulative_int32_and_shared_by_equal_splits():
    offs = experts.group_offsets(SPLITS, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 5, 8, 8, 17, 18, 18]
    assert experts.group_offsets(list(SPLITS), torch.device("cpu")) is offs  # fc2 reuses fc1's
    assert experts.group_offsets([1] * 7, torch.device("cpu")) is not offs
    as_tensor = experts.group_offsets(torch.tensor(SPLITS), torch.device("cpu"))
    assert as_tensor.dtype == torch.int32 and as_tensor.tolist() == offs.tolist()


def test_forward_and_gradients_match_per_expert_matmuls():
    weights = expert_weights()
    m = sum(SPLITS)
    x = rows(m).requires_grad_(True)
    dy = rows(m, OUT, seed=2)
    out = experts.grouped_mm(x, SPLITS, weights)
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
    experts.grouped_mm(x, SPLITS, weights).sum().backward()
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
    experts.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
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
    assert experts._wgrad_out_dtype(torch.float32, torch.device("cpu")) is None
    assert experts._fp32_wgrad_supported == {"cpu": False}
    assert experts._wgrad_out_dtype(torch.bfloat16, torch.device("cpu")) is None


def test_overwrite_main_grad_and_zero_out_wgrad():
    weights = ddp_managed(expert_weights(), overwrite_main_grad=True, zero_out_wgrad=True)
    x = rows(sum(SPLITS))
    dy = rows(sum(SPLITS), OUT, seed=2)
    experts.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    _, _, ref_dws = reference(x, SPLITS, weights, dy)
    for w, ref_dw in zip(weights, ref_dws):
        close(w.main_grad, ref_dw)  # the prior 0.5 is gone
        # With zero_out_wgrad DDP adds param.grad anyway: it must be zeros.
        assert torch.count_nonzero(w.grad) == 0


def test_no_rows_leaves_main_grad_and_still_hands_ddp_a_gradient():
    weights = ddp_managed(expert_weights())
    x = rows(0).requires_grad_(True)
    out = experts.grouped_mm(x, [0] * len(weights), weights, fuse_accumulation=True)
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
        experts.grouped_mm(rows(sum(SPLITS)), SPLITS, weights, fuse_accumulation=True).sum().backward()


class FakeTEGroupedLinear(torch.nn.Module):
    """The attributes of megatron's TE grouped linear that the mixin reads."""

    def __init__(self, num_gemms, input_size, output_size, **_):
        super().__init__()
        self.num_gemms = num_gemms
        self.is_first_microbatch = True
        for i, w in enumerate(expert_weights(num_gemms, shape=(output_size, input_size))):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w.detach().clone()))

    def forward(self, x, m_splits):
        raise AssertionError("the TE forward must not run")


def test_linear_subclass_runs_the_grouped_gemm_on_its_own_weights(capsys, monkeypatch):
    monkeypatch.setattr(experts, "_announced", set())
    cls = experts.grouped_mm_linear(FakeTEGroupedLinear, "Column")
    assert issubclass(cls, FakeTEGroupedLinear) and cls.__name__ == "GroupedMMColumnParallelGroupedLinear"
    linear = cls(len(SPLITS), IN, OUT)
    cls(len(SPLITS), IN, OUT)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("megatron-patchset: experts'")]
    assert lines == [f"megatron-patchset: experts' GroupedMMColumnParallelGroupedLinear runs forward, dgrad and "
                     f"wgrad as one torch grouped_mm each ({len(SPLITS)} local experts, {IN} -> {OUT} before "
                     f"tensor parallelism)"]
    x = rows(sum(SPLITS))
    out, bias = linear(x, SPLITS)
    assert bias is None and linear.is_first_microbatch is False
    weights = [getattr(linear, f"weight{i}") for i in range(len(SPLITS))]
    close(out, reference(x, SPLITS, weights, torch.zeros(sum(SPLITS), OUT))[0])
    out.sum().backward()
    assert all(w.grad is not None for w in weights)  # no DDP attributes: plain gradients
    with pytest.raises(RuntimeError, match="bf16"):
        linear(x.float(), SPLITS)


def grouped_mlp(splits):
    import torch.nn.functional as F
    from types import SimpleNamespace

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=4, num_moe_experts=len(splits),
        moe_ffn_hidden_size=OUT, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16,
    )
    submodules = GroupedMLPSubmodules(linear_fc1=experts.grouped_mm_linear(FakeTEGroupedLinear, "Column"),
                                      linear_fc2=experts.grouped_mm_linear(FakeTEGroupedLinear, "Row"))
    return TEGroupedMLP(len(splits), config, submodules, pg_collection=SimpleNamespace(ep=None, expt_tp=None))


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
        w1, w2 = getattr(mlp.linear_fc1, f"weight{e}").float(), getattr(mlp.linear_fc2, f"weight{e}").float()
        gate, up = torch.chunk(x[start:start + n].detach().float() @ w1.t(), 2, dim=-1)
        expected.append((F.silu(gate) * up * probs[start:start + n, None]) @ w2.t())
        start += n
    close(out, torch.cat(expected))
    out.float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert torch.count_nonzero(mlp.linear_fc1.weight1.grad) == 0  # the expert without tokens
    assert torch.count_nonzero(mlp.linear_fc2.weight2.grad) > 0


def test_without_transformer_engine_the_patch_names_it():
    with pytest.raises(PatchsetError, match="TransformerEngine is not installed"):
        experts.grouped_mm_linear(None, "Row")


def test_patches_rebind_the_names_te_spec_provider_builds_experts_from(monkeypatch):
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    # No TE on the CPU: stand-ins take the place of megatron's TE grouped linears.
    column = type("TEColumnParallelGroupedLinear", (FakeTEGroupedLinear,), {})
    row = type("TERowParallelGroupedLinear", (FakeTEGroupedLinear,), {})
    monkeypatch.setattr(provider, "TEColumnParallelGroupedLinear", column)
    monkeypatch.setattr(provider, "TERowParallelGroupedLinear", row)
    names = ["experts.grouped_mm_fc1", "experts.grouped_mm_fc2"]
    assert all(patches.get(n).wanted(tiny_parsed("--moe-grouped-gemm-impl", "torch")) for n in names)
    assert not any(patches.get(n).wanted(tiny_parsed()) for n in names)
    try:
        assert patches.apply_patches([patches.get(n) for n in names]) == names
        spec = provider.TESpecProvider().grouped_mlp_modules(True)
        assert spec.func is TEGroupedMLP
        fc1, fc2 = spec.keywords["submodules"].linear_fc1, spec.keywords["submodules"].linear_fc2
        assert issubclass(fc1, column) and issubclass(fc1, experts.GroupedMMForward)
        assert issubclass(fc2, row) and issubclass(fc2, experts.GroupedMMForward)
        assert patches.patched_by(fc1) == "experts.grouped_mm_fc1"
    finally:
        patches.revert(names)
    assert provider.TEColumnParallelGroupedLinear is column and provider.TERowParallelGroupedLinear is row


def tiny_parsed(*extra):
    from tests.unit.conftest import parse

    return parse(tiny_argv(*extra))


TORCH = ("--moe-grouped-gemm-impl", "torch")


def test_rule_accepts_the_tiny_config():
    assert failures(tiny_argv(*TORCH)) == {}


@pytest.mark.parametrize("extra, expected", [
    (("--transformer-impl", "local"), "--transformer-impl transformer_engine"),
    (("--delay-wgrad-compute",), "--delay-wgrad-compute"),
    (("--use-transformer-engine-op-fuser",), "--use-transformer-engine-op-fuser"),
    (("--cuda-graph-impl", "transformer_engine"), "leave the experts out"),
    (("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe"), "leave the experts out"),
])
def test_rule_refuses_what_the_grouped_gemm_does_not_implement(extra, expected):
    got = failures(tiny_argv(*TORCH, *extra))
    assert expected in got["moe-grouped-gemm-impl-torch-requirements"]


def test_rule_allows_graphs_around_the_experts():
    argv = tiny_argv(*TORCH, "--cuda-graph-impl", "transformer_engine",
                     "--cuda-graph-modules", "attn", "moe_router", "moe_preprocess")
    assert "moe-grouped-gemm-impl-torch-requirements" not in failures(argv)


def test_rule_needs_bf16_grouped_gemm_and_no_bias():
    argv = [a for a in tiny_argv(*TORCH) if a not in ("--bf16", "--moe-grouped-gemm", "--disable-bias-linear")]
    message = failures(argv)["moe-grouped-gemm-impl-torch-requirements"]
    assert "--bf16" in message and "--moe-grouped-gemm" in message and "--disable-bias-linear" in message


def test_alignment_rule_names_the_width():
    got = failures(tiny_argv(*TORCH, "--moe-ffn-hidden-size", "500"))
    assert "--moe-ffn-hidden-size / expert tensor parallel size 1 = 500" in got["moe-grouped-gemm-impl-torch-alignment"]
    assert "moe-grouped-gemm-impl-torch-alignment" not in failures(tiny_argv(*TORCH))


# ---------------------------------------------------------------------------------------
# --moe-expert-splits-on-device
# ---------------------------------------------------------------------------------------

SPLITS_ON_DEVICE = ("--moe-expert-splits-on-device", "--moe-permute-fusion")
SPLIT_PATCHES = ["experts.splits_on_device_dispatcher", "experts.splits_on_device_grouped_mlp"]


@pytest.fixture
def split_patches():
    patches.apply_patches([patches.get(n) for n in SPLIT_PATCHES])
    try:
        yield
    finally:
        patches.revert(SPLIT_PATCHES)


def test_device_splits_give_the_offsets_of_the_counts_without_a_host_list():
    splits = experts.DeviceSplits(torch.tensor(SPLITS))
    assert splits.tolist() is splits and len(splits) == len(SPLITS)
    offs = experts.group_offsets(splits, torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 5, 8, 8, 17, 18, 18]
    assert experts._offsets_cache == {}  # the host-list cache is not involved


def test_grouped_mlp_reads_the_token_counts_without_tolist(monkeypatch):
    """With the patch TEGroupedMLP never turns the counts tensor into a host list (on a GPU that is
    the device-to-host copy and sync), and computes exactly what upstream's host-list path does."""
    splits = [3, 0, 6, 2]
    mlp = grouped_mlp(splits)
    x = rows(sum(splits), IN)
    probs = torch.rand(sum(splits), generator=torch.Generator().manual_seed(3))
    expected, _ = mlp(x, torch.tensor(splits), probs)  # upstream: .tolist(), offsets from the host list

    def refuse(self):
        raise AssertionError("tokens_per_expert.tolist() called")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    with pytest.raises(AssertionError, match="tolist"):
        mlp(x, torch.tensor(splits), probs)
    name = "experts.splits_on_device_grouped_mlp"
    patches.apply_patches([patches.get(name)])
    try:
        out, bias = mlp(x, torch.tensor(splits), probs)
    finally:
        patches.revert([name])
    assert bias is None
    assert torch.equal(out, expected)


def test_grouped_mlp_patch_refuses_te_linears(split_patches):
    from types import SimpleNamespace

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    fake = SimpleNamespace(linear_fc1=FakeTEGroupedLinear(2, IN, OUT), _with_fused_impl=False)
    with pytest.raises(RuntimeError, match="--moe-grouped-gemm-impl torch"):
        TEGroupedMLP.forward(fake, rows(2), torch.tensor([1, 1]), torch.ones(2))


@pytest.fixture
def alltoall_dispatcher(monkeypatch):
    """A real MoEAlltoAllTokenDispatcher of megatron on one gloo rank (EP = TP = 1), 4 experts top-2."""
    import warnings

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit import cpu_shims

    cpu_shims.install(monkeypatch)
    host_copies = []
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def counting_to_host(tensor, *args, **kwargs):
        if torch.is_tensor(tensor):
            host_copies.append(tuple(tensor.shape))
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", counting_to_host)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()

        def build(num_local_experts=4, **overrides):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = TransformerConfig(
                    num_layers=1, hidden_size=IN, num_attention_heads=4, num_moe_experts=num_local_experts,
                    moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
                    moe_ffn_hidden_size=OUT, **overrides,
                )
            dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher(
                num_local_experts, list(range(num_local_experts)), config,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            )
            return dispatcher

        yield build, host_copies
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def routing(tokens=6, experts_=4, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(tokens, experts_, generator=gen).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts_, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map, routing_map.float() * 0.5


def test_dispatcher_returns_the_counts_on_the_device_through_megatrons_own_dispatch(alltoall_dispatcher,
                                                                                    split_patches):
    """One local expert (no chunk sort): megatron's dispatch path end to end; the token counts it
    hands the experts are the tensor preprocess computed, and nothing was copied to the host."""
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=1)
    routing_map, probs = routing(experts_=1, topk=1)
    hidden = rows(6)
    tokens, probs_out = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, probs_out = dispatcher.token_dispatch(tokens, probs_out)
    tokens, tokens_per_expert, _ = dispatcher.dispatch_postprocess(tokens, probs_out)
    assert torch.is_tensor(tokens_per_expert) and tokens_per_expert.tolist() == [6]
    assert host_copies == []
    assert not hasattr(dispatcher, "d2h_event")  # upstream records (and waits for) it
    assert tokens.shape == (6, IN)


def test_without_the_patch_the_dispatcher_copies_the_counts_to_the_host(alltoall_dispatcher):
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=1)
    routing_map, probs = routing(experts_=1, topk=1)
    tokens, probs_out = dispatcher.dispatch_preprocess(rows(6), routing_map, probs)
    tokens, probs_out = dispatcher.token_dispatch(tokens, probs_out)
    dispatcher.dispatch_postprocess(tokens, probs_out)
    assert (1,) in host_copies and hasattr(dispatcher, "d2h_event")


def test_dispatcher_patch_at_every_sync_point_and_its_refusals(alltoall_dispatcher, split_patches):
    build, host_copies = alltoall_dispatcher
    dispatcher = build(num_local_experts=4)
    routing_map, _ = routing()
    counts = dispatcher.preprocess(routing_map)
    # Four local experts without the fused chunk sort: the sort needs host split sizes.
    with pytest.raises(RuntimeError, match="--moe-permute-fusion"):
        dispatcher._maybe_dtoh_and_synchronize("before_permutation_1", counts)
    dispatcher.config.moe_permute_fusion = True
    for point in dispatcher.cuda_sync_point_priority:
        assert dispatcher._maybe_dtoh_and_synchronize(point, counts) is counts
    assert host_copies == [] and torch.equal(counts, routing_map.sum(0))
    dispatcher.ep_size = 2
    with pytest.raises(RuntimeError, match="expert parallelism"):
        dispatcher._maybe_dtoh_and_synchronize("before_finish", counts)


def test_splits_rule_accepts_the_single_gpu_alltoall_layout():
    assert failures(tiny_argv(*TORCH, *SPLITS_ON_DEVICE)) == {}
    full = tiny_argv(*TORCH, *SPLITS_ON_DEVICE, "--cuda-graph-impl", "full_iteration",
                     "--no-check-for-nan-in-loss-and-grad")
    assert failures(full) == {}


@pytest.mark.parametrize("extra, expected", [
    ((), "--moe-grouped-gemm-impl torch"),
    (("--moe-token-dispatcher-type", "allgather"), "--moe-token-dispatcher-type alltoall"),
    (("--expert-model-parallel-size", "2"), "--expert-model-parallel-size 1"),
    (("--moe-expert-capacity-factor", "1.5"), "no --moe-expert-capacity-factor"),
])
def test_splits_rule_refuses_layouts_that_need_host_counts(extra, expected):
    torch_impl = TORCH if extra else ()
    got = failures(tiny_argv(*torch_impl, *SPLITS_ON_DEVICE, *extra), world_size=2)
    assert expected in got["moe-expert-splits-on-device-requirements"]


def test_splits_rule_needs_permute_fusion():
    got = failures(tiny_argv(*TORCH, "--moe-expert-splits-on-device"))
    assert "--moe-permute-fusion" in got["moe-expert-splits-on-device-requirements"]


def test_full_iteration_graphs_need_the_counts_on_the_device():
    argv = tiny_argv(*TORCH, "--moe-permute-fusion", "--cuda-graph-impl", "full_iteration",
                     "--no-check-for-nan-in-loss-and-grad")
    assert "--moe-expert-splits-on-device for --cuda-graph-impl full_iteration" in \
        failures(argv)["moe-grouped-gemm-impl-torch-requirements"]


@pytest.mark.parametrize("descending", [False, True])
def test_main_grads_back_to_back_take_one_add(descending, monkeypatch):
    """DDP's buffer holds a layer's expert main grads back to back (in reverse order): the weight
    gradient goes in with one add over a view of them, not a foreach over the experts."""
    weights = expert_weights()
    buffer = torch.full((len(weights), OUT, IN), 0.5)
    for i, w in enumerate(weights):
        w.main_grad = buffer[len(weights) - 1 - i] if descending else buffer[i]
        w.grad_added_to_main_grad = False
    view, flipped = experts.stacked_view([w.main_grad for w in weights])
    assert flipped is descending and view.data_ptr() == buffer.data_ptr()

    def refuse(*args, **kwargs):
        raise AssertionError("foreach path taken")

    monkeypatch.setattr(torch, "_foreach_add_", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    experts.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_scattered_main_grads_take_the_foreach_path_in_one_dtype(monkeypatch):
    weights = ddp_managed(expert_weights())  # separate fp32 tensors
    assert experts.stacked_view([w.main_grad for w in weights]) is None
    seen = []
    add = torch._foreach_add_

    def record(selves, others):
        seen.append({t.dtype for t in others})
        return add(selves, others)

    monkeypatch.setattr(torch, "_foreach_add_", record)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    experts.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    assert seen == [{torch.float32}]  # bf16 gradients cast once, so the multi-tensor kernel applies
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_stacked_view_refuses_gaps_and_mixed_shapes():
    buffer = torch.zeros(5, 2, 3)
    assert experts.stacked_view([buffer[0], buffer[1], buffer[3]]) is None
    assert experts.stacked_view([buffer[0], buffer[1, :1]]) is None
    assert experts.stacked_view([buffer[0], torch.zeros(2, 3)]) is None
    view, descending = experts.stacked_view([buffer[2]])
    assert view.shape == (1, 2, 3) and not descending


FULL = ("--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad")


def test_full_iteration_graphs_refuse_host_read_token_counts():
    got = failures(tiny_argv(*FULL))
    assert "--moe-expert-splits-on-device" in got["full-iteration-graphs-dropless-moe"]
    assert "full-iteration-graphs-dropless-moe" not in failures(tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL))
    padded = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
    assert "full-iteration-graphs-dropless-moe" not in failures(tiny_argv(*FULL, *padded))


def test_full_iteration_graphs_refuse_megatrons_timers():
    argv = tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL, "--timing-log-level", "1")
    assert "--timing-log-level 0" in failures(argv)["full-iteration-graphs-timers"]
    assert "full-iteration-graphs-timers" not in failures(tiny_argv("--timing-log-level", "2"))


def test_named_rules_can_be_skipped_for_negative_controls(monkeypatch, capsys):
    from megatron.patchset import arguments

    monkeypatch.setenv(arguments.SKIP_RULES_ENV, "full-iteration-graphs-dropless-moe")
    assert failures(tiny_argv(*FULL)) == {}
    assert "rule full-iteration-graphs-dropless-moe skipped" in capsys.readouterr().out
    monkeypatch.setenv(arguments.SKIP_RULES_ENV, "no-such-rule")
    with pytest.raises(ValueError, match="no-such-rule"):
        failures(tiny_argv())


def test_inside_a_graph_capture_the_reversed_copy_is_skipped(monkeypatch):
    """While a CUDA graph is captured, launches are free at replay: the main grads lying in reverse
    order take one add per expert instead of a reversed copy of the weight gradients plus one add."""
    weights = expert_weights()
    buffer = torch.full((len(weights), OUT, IN), 0.5)
    for i, w in enumerate(weights):
        w.main_grad = buffer[len(weights) - 1 - i]
        w.grad_added_to_main_grad = False
    experts._wgrad_out_dtype(torch.float32, torch.device("cpu"))  # the probe runs before any capture
    monkeypatch.setattr(experts, "capturing", lambda device: True)

    def refuse(*args, **kwargs):
        raise AssertionError("reversed copy made")

    monkeypatch.setattr(torch.Tensor, "flip", refuse)
    x, dy = rows(sum(SPLITS)), rows(sum(SPLITS), OUT, seed=2)
    experts.grouped_mm(x, SPLITS, weights, fuse_accumulation=True).backward(dy)
    for w, ref_dw in zip(weights, reference(x, SPLITS, weights, dy)[2]):
        close(w.main_grad, ref_dw + 0.5)


def test_device_splits_feed_megatrons_tokens_per_expert_log(tmp_path):
    """megatron's --save-tokens-per-expert-interval hook records list(m_splits) of every experts'
    fc1 input; device splits give it the counts (a host read only in that logging step)."""
    from megatron.training.activation_logging import ActivationLogger

    logger = ActivationLogger(str(tmp_path))
    hook = logger._make_tpe_hook("model", "decoder.layers.3.mlp.experts.linear_fc1")
    hook(None, (rows(5), experts.DeviceSplits(torch.tensor([3, 0, 2]))), {}, None)
    assert [list(r) for r in logger._decoder_tpe_records.values()] == [[[3, 0, 2]]]


@pytest.mark.parametrize("extra, expected", [
    (("--expert-tensor-parallel-size", "2"), "expert tensor parallel size 1"),
    (("--moe-router-padding-for-quantization",), "no --moe-router-padding-for-quantization"),
    (("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router", "moe_preprocess"),
     "no per-layer CUDA graphs over the MoE router"),
])
def test_splits_rule_refuses_host_counts_and_per_layer_graphs(extra, expected):
    got = failures(tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *extra), world_size=2)
    assert expected in got["moe-expert-splits-on-device-requirements"]


def test_splits_rule_takes_a_negative_capacity_factor_as_dropless():
    assert "moe-expert-splits-on-device-requirements" not in failures(
        tiny_argv(*TORCH, *SPLITS_ON_DEVICE, "--moe-expert-capacity-factor", "-1"))


def test_full_iteration_graphs_need_an_eager_step_before_the_capture():
    argv = tiny_argv(*TORCH, *SPLITS_ON_DEVICE, *FULL, "--cuda-graph-warmup-steps", "0")
    assert "--cuda-graph-warmup-steps 1 or more" in failures(argv)["moe-grouped-gemm-impl-torch-requirements"]


def test_drop_and_pad_is_static_only_in_the_alltoall_dispatcher():
    padded = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
    got = failures(tiny_argv(*FULL, *padded, "--moe-token-dispatcher-type", "allgather"))
    assert "--moe-token-dispatcher-type alltoall" in got["full-iteration-graphs-dropless-moe"]


def test_the_fp32_probe_refuses_to_run_inside_a_capture(monkeypatch):
    monkeypatch.setattr(experts, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="--cuda-graph-warmup-steps 1 or more"):
        experts._wgrad_out_dtype(torch.float32, torch.device("cpu"))
    assert experts._fp32_wgrad_supported == {}
