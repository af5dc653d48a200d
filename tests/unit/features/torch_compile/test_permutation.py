"""torch_compile.moe_permute_traceable / torch_compile.moe_unpermute_traceable: the dropless
all-to-all permutation as gathers while compiling, against megatron's own (unfused) permute and
unpermute."""

import types

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from megatron.patchset.core import registry
from megatron.patchset.features.torch_compile import flags as compile_flags
from megatron.patchset.features.torch_compile import layers, permutation, tracing
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.torch_compile.conftest import breaks

TOKENS, EXPERTS, TOPK, HIDDEN = 24, 8, 3, 16


def routing(seed=0, tokens=TOKENS, experts=EXPERTS, topk=TOPK):
    """A dropless top-k routing: exactly ``topk`` experts per token, and its probabilities."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64)
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.zeros(tokens, experts, dtype=torch.float64).scatter_(
        1, top, logits.softmax(1).gather(1, top)
    )
    return routing_map, probs


@pytest.fixture
def permute_topk():
    tracing.PERMUTE_TOPK[0] = TOPK
    yield TOPK
    tracing.PERMUTE_TOPK[0] = None


def test_permutation_patches_wanted_with_compile_and_permute_fusion():
    def wanted(*extra):
        return {p.name for p in registry.wanted(parse(tiny_argv(*extra)))} & set(
            permutation.PERMUTATION_PATCHES
        )

    assert wanted("--compile-transformer-layers") == set()
    assert wanted("--moe-permute-fusion") == set()
    assert wanted("--compile-transformer-layers", "--moe-permute-fusion") == set(
        permutation.PERMUTATION_PATCHES
    )
    assert (
        wanted(
            "--compile-transformer-layers",
            "--moe-permute-fusion",
            "--compile-transformer-layers-te-kernels",
        )
        == set()
    )
    # the names the dispatcher looks up (it imports them from moe_utils)
    assert {registry.get(n).target for n in permutation.PERMUTATION_PATCHES} == {
        "megatron.core.transformer.moe.token_dispatcher.permute",
        "megatron.core.transformer.moe.token_dispatcher.unpermute",
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_permute_is_megatrons_permutation_with_the_same_gradients(seed):
    routing_map, probs = routing(seed)
    num_out = TOKENS * TOPK
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    p = probs.clone().requires_grad_()
    got, got_probs, rows = permutation.gather_permute(x, routing_map, p, num_out, TOPK)
    x_ref = x.detach().clone().requires_grad_()
    p_ref = probs.clone().requires_grad_()
    want, want_probs, want_rows, _, _ = moe_utils.permute(
        x_ref, routing_map, probs=p_ref, num_out_tokens=num_out
    )
    assert torch.equal(rows, want_rows)
    assert torch.equal(got, want) and torch.equal(got_probs, want_probs)
    # expert-major, tokens ascending within an expert
    experts_of_rows = routing_map.T.nonzero()[:, 0]
    assert (
        torch.equal(got, x.detach()[routing_map.T.nonzero()[:, 1]])
        and experts_of_rows.diff().min() >= 0
    )
    g, gp = torch.randn_like(got), torch.randn_like(got_probs)
    ((got * g).sum() + (got_probs * gp).sum()).backward()
    ((want * g).sum() + (want_probs * gp).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0)


def test_sum_unpermute_is_megatrons_unpermutation_with_the_same_gradients():
    routing_map, _ = routing(2)
    num_out = TOKENS * TOPK
    _, _, rows, _, _ = moe_utils.permute(
        torch.zeros(TOKENS, HIDDEN), routing_map, num_out_tokens=num_out
    )
    y = torch.randn(num_out, HIDDEN, dtype=torch.float64, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    got = permutation.sum_unpermute(y, rows, torch.Size((TOKENS, HIDDEN)))
    want = moe_utils.unpermute(y_ref, rows, torch.Size((TOKENS, HIDDEN)), routing_map=routing_map)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    assert torch.equal(y.grad, y_ref.grad)


def test_sum_unpermute_accumulates_bf16_rows_in_fp32():
    # k rows of a token: 1 + 2**-9 summed in bf16 one at a time round back to 1 each step
    rows = torch.tensor([0, 0, 0, 0])
    y = torch.tensor([[1.0], [2**-8], [2**-8], [2**-8]], dtype=torch.bfloat16)
    out = permutation.sum_unpermute(y, rows, torch.Size((1, 1)))
    assert out.dtype == torch.bfloat16 and out.item() == pytest.approx(1 + 3 * 2**-8, abs=2**-8)


def _wrappers():
    calls = []

    def permute(*args, **kwargs):
        calls.append(("permute", kwargs.get("fused")))
        return moe_utils.permute(*args, **dict(kwargs, fused=False))

    def unpermute(*args, **kwargs):
        calls.append(("unpermute", kwargs.get("fused")))
        return moe_utils.unpermute(*args, **dict(kwargs, fused=False))

    return permutation._permute_factory(permute), permutation._unpermute_factory(unpermute), calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permutation_traces_without_a_graph_break(
    dtype, fresh_dynamo, in_compiled_layer, permute_topk
):
    permute, unpermute, calls = _wrappers()
    routing_map, probs = routing(3)
    shape = torch.Size((TOKENS, HIDDEN))

    def moe(x, routing_map, probs):
        permuted, permuted_probs, rows, _, _ = permute(
            x, routing_map, probs=probs, num_out_tokens=TOKENS * TOPK, fused=True
        )
        return unpermute(
            permuted * permuted_probs.unsqueeze(-1),
            rows,
            shape,
            routing_map=routing_map,
            fused=True,
        )

    x = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    p = probs.to(dtype).requires_grad_()
    out = torch.compile(moe, backend="aot_eager", fullgraph=True)(x, routing_map, p)
    assert calls == [] and breaks(fresh_dynamo) == 0
    tracing.IN_COMPILED_LAYER[0] = False  # eager: upstream's functions (here unfused) run
    x_ref, p_ref = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    permuted, permuted_probs, rows, _, _ = moe_utils.permute(
        x_ref, routing_map, probs=p_ref, num_out_tokens=TOKENS * TOPK
    )
    want = moe_utils.unpermute(
        permuted * permuted_probs.unsqueeze(-1), rows, shape, routing_map=routing_map
    )
    # bf16: upstream's unfused unpermute adds a token's rows in bf16, the gathered one in fp32
    tol = dict(rtol=0.02, atol=0.02) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, want, **tol)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert x.grad.abs().max() > 0 and p.grad.abs().max() > 0
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(p.grad, p_ref.grad, **tol)


@pytest.mark.parametrize(
    "case", ["eager", "no_topk", "unfused", "drop_and_pad", "align", "num_out"]
)
def test_permute_leaves_other_cases_to_upstream(case, in_compiled_layer, permute_topk):
    permute, _, calls = _wrappers()
    routing_map, probs = routing(4)
    kwargs = dict(probs=probs, num_out_tokens=TOKENS * TOPK, fused=True)
    if case == "eager":
        tracing.IN_COMPILED_LAYER[0] = False
    elif case == "no_topk":
        tracing.PERMUTE_TOPK[0] = None
    elif case == "unfused":
        kwargs["fused"] = False
    elif case == "drop_and_pad":
        kwargs["drop_and_pad"] = True
    elif case == "align":
        kwargs["align_size"] = 16
    elif case == "num_out":
        kwargs["num_out_tokens"] = TOKENS * TOPK - 1

    @torch.compile(backend="eager")
    def run(x):
        return permute(x, routing_map, **kwargs)[0]

    (run if case != "eager" else run.__wrapped__)(torch.randn(TOKENS, HIDDEN, dtype=torch.float64))
    assert calls == [("permute", kwargs["fused"])]


def test_unpermute_undoes_a_gathered_permutation_eagerly_and_leaves_te_maps_to_te():
    _, unpermute, calls = _wrappers()
    routing_map, _ = routing(5)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
    permuted, _, rows = permutation.gather_permute(x, routing_map, None, TOKENS * TOPK, TOPK)
    shape = torch.Size((TOKENS, HIDDEN))
    torch.testing.assert_close(
        unpermute(permuted, rows, shape, routing_map=routing_map, fused=True), x * TOPK
    )
    assert calls == []
    te_style_map = torch.zeros(TOKENS, 2 * EXPERTS + 1, dtype=torch.int32)  # TE's mask map is 2-D
    to_te = permutation._unpermute_factory(lambda *args, **kwargs: ("te", kwargs["fused"]))
    assert to_te(permuted, te_style_map, shape, routing_map=routing_map, fused=True) == ("te", True)
    with pytest.raises(registry.PatchsetError, match="merging probabilities"):
        unpermute(
            permuted,
            rows,
            shape,
            probs=torch.ones(TOKENS, EXPERTS),
            routing_map=routing_map,
            fused=True,
        )


def _dispatcher(**overrides):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    config = dict(
        moe_permute_fusion=True,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_router_padding_for_quantization=False,
        moe_router_topk=8,
    )
    config.update(overrides)
    dispatcher = MoEAlltoAllTokenDispatcher.__new__(MoEAlltoAllTokenDispatcher)
    dispatcher.config = types.SimpleNamespace(**config)
    return dispatcher


def test_permutation_topk_only_for_dropless_fused_all_to_all():
    assert permutation.permutation_topk(_dispatcher()) == 8
    assert permutation.permutation_topk(_dispatcher(moe_permute_fusion=False)) is None
    assert permutation.permutation_topk(_dispatcher(moe_expert_capacity_factor=1.0)) is None
    assert permutation.permutation_topk(_dispatcher(moe_pad_expert_input_to_capacity=True)) is None
    assert (
        permutation.permutation_topk(_dispatcher(moe_router_padding_for_quantization=True)) is None
    )
    assert permutation.permutation_topk(types.SimpleNamespace(config=_dispatcher().config)) is None


def test_compiled_layer_wrapper_sets_the_layers_topk():
    seen = []
    layer = torch.nn.Linear(4, 4)
    layer.forward = lambda x: (
        seen.append((tracing.PERMUTE_TOPK[0], tracing.IN_COMPILED_LAYER[0])) or x
    )
    layers.compile_layer(layer, compile_flags.CompileOptions(backend="eager"), None, permute_topk=8)
    layer.forward(torch.randn(2, 4))
    assert seen == [(8, True)]
    assert tracing.PERMUTE_TOPK[0] is None and tracing.IN_COMPILED_LAYER[0] is False


def test_permutation_report_counts_layers(monkeypatch):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def layer(dispatcher):
        module = TransformerLayer.__new__(TransformerLayer)
        torch.nn.Module.__init__(module)
        module.mlp = torch.nn.Module()
        module.mlp.token_dispatcher = dispatcher
        return module

    chunk = torch.nn.ModuleList(
        [layer(_dispatcher()), layer(_dispatcher(moe_expert_capacity_factor=1.0))]
    )
    monkeypatch.setattr(layers, "applied", lambda: list(permutation.PERMUTATION_PATCHES))
    assert layers.permutation_report([chunk]) == (
        "; MoE permutation as gathers in 1 of 2 MoE layers (the others: TE's kernels; dropless "
        "all-to-all only)"
    )
    assert layers.layer_permutation_topk(chunk[0]) == 8
    monkeypatch.setattr(layers, "applied", lambda: [permutation.PERMUTATION_PATCHES[0]])
    assert (
        layers.permutation_report([chunk]) == "" and layers.layer_permutation_topk(chunk[0]) is None
    )
