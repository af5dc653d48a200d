"""The TE spec's attention block as torch code inside compiled layers (features/torch_compile).

While dynamo traces a compiled TransformerLayer, megatron's TE QKV ``LayerNormLinear``, output
``Linear`` and ``DotProductAttention`` (compile-disabled by TE: a graph break in every enclosing
frame) run as ``traceable_norm`` + ``F.linear`` and SDPA, in the plain bf16 single-rank case; eager
calls and every other case keep TE. There is no TE on the CPU: stand-ins with the attributes the
eligibility checks read play TE's modules, with a compile-disabled "kernel" that counts its calls.
The GPU check against TE itself is tests/gpu/features/torch_compile/test_compile.py."""

import types

import pytest
import torch
import torch.nn.functional as F

from megatron.patchset.core import registry
from megatron.patchset.features.torch_compile import attention_block, layers, tracing
from megatron.patchset.features.torch_compile import flags as compile_flags
from tests.unit.conftest import parse, tiny_argv
from tests.unit.features.torch_compile.conftest import breaks


def _config(**kw):
    return types.SimpleNamespace(
        **{
            "fp8": None,
            "fp4": None,
            "delay_wgrad_compute": False,
            "qk_clip": False,
            "log_max_attention_logit": False,
            **kw,
        }
    )


class StandInLinear(torch.nn.Module):
    """megatron's TELinear as the checks see it; ``forward`` is the compile-disabled TE call."""

    def __init__(self, n_in, n_out, *, bias=False, return_bias=False, **attrs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        self.use_bias = bias
        self.bias = torch.nn.Parameter(torch.randn(n_out)) if bias else torch.Tensor()
        self.te_return_bias = return_bias and bias
        self.tp_size, self.fuse_wgrad_accumulation, self.weight_names = 1, False, ["weight"]
        self.te_quant_params, self.config, self.calls = None, _config(), 0
        for name, value in attrs.items():
            setattr(self, name, value)

    def _reference(self, x):
        return F.linear(
            x, self.weight, self.bias if self.use_bias and not self.te_return_bias else None
        )

    def forward(self, x):
        return self._te(x)

    @torch.compiler.disable
    def _te(self, x):
        self.calls += 1
        return self._reference(x), (self.bias if self.te_return_bias else None)


class StandInLayerNormLinear(StandInLinear):
    def __init__(self, n_in, n_out, *, normalization="RMSNorm", zero_centered_gamma=False, **kw):
        super().__init__(n_in, n_out, **kw)
        self.layer_norm_weight = torch.nn.Parameter(torch.randn(n_in))
        self.layer_norm_bias = (
            torch.nn.Parameter(torch.randn(n_in)) if normalization == "LayerNorm" else None
        )
        self.normalization, self.zero_centered_gamma, self.eps = (
            normalization,
            zero_centered_gamma,
            1e-6,
        )
        self.return_layernorm_output = False

    def _reference(self, x):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            normed = F.rms_norm(x, (x.shape[-1],), gamma, eps=self.eps)
        else:
            normed = F.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias, eps=self.eps)
        return super()._reference(normed)


def reference_attention(q, k, v, causal, scale):
    """sbhd softmax attention, grouped-query heads repeated, written out."""
    s, b, h, d = q.shape
    k = k.repeat_interleave(h // k.shape[2], dim=2)
    v = v.repeat_interleave(h // v.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * d)


class Mask:
    def __init__(self, name):
        self.name = name


class StandInAttention(torch.nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        self.qkv_format, self.window_size, self.attention_dropout = "sbhd", (-1, 0), 0.0
        self.softmax_type, self.softcap, self.return_max_logit, self.deterministic = (
            "vanilla",
            None,
            False,
            False,
        )
        self.cp_group, self.num_splits, self.softmax_scale, self.config, self.calls = (
            None,
            None,
            0.25,
            _config(),
            0,
        )
        for name, value in attrs.items():
            setattr(self, name, value)

    @torch.compiler.disable
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type,
        attention_bias=None,
        packed_seq_params=None,
        num_splits=None,
    ):
        self.calls += 1
        return reference_attention(
            query, key, value, attn_mask_type.name == "causal", self.softmax_scale
        )


def test_attention_block_patches_wanted_only_with_compile_and_the_te_spec():
    def wanted(*extra):
        return {p.name for p in registry.wanted(parse(tiny_argv(*extra)))} & set(
            attention_block.ATTENTION_BLOCK_PATCHES
        )

    assert wanted() == set()
    assert wanted("--compile-transformer-layers") == set(attention_block.ATTENTION_BLOCK_PATCHES)
    assert wanted("--compile-transformer-layers", "--transformer-impl", "local") == set()
    assert (
        wanted("--compile-transformer-layers", "--compile-transformer-layers-te-kernels") == set()
    )
    # forward of megatron's wrapper classes, patched in place (MLA compares the classes by identity)
    assert {
        registry.get(name).target.rsplit(".", 2)[-2:][0]
        for name in attention_block.ATTENTION_BLOCK_PATCHES
    } == {"TELayerNormColumnParallelLinear", "TELinear", "TEDotProductAttention"}
    assert all(
        registry.get(name).target.startswith("megatron.core.extensions.transformer_engine.")
        and registry.get(name).target.endswith(".forward")
        for name in attention_block.ATTENTION_BLOCK_PATCHES
    )


@pytest.mark.parametrize("bias,return_bias", [(False, False), (True, False), (True, True)])
def test_traceable_linear_keeps_te_bias_contract(bias, return_bias):
    module = StandInLinear(16, 8, bias=bias, return_bias=return_bias)
    x = torch.randn(5, 2, 16)
    out, returned = attention_block.traceable_linear(module, x)
    ref, ref_returned = module._te(x)
    torch.testing.assert_close(out, ref)
    assert (returned is None) == (ref_returned is None)
    if return_bias:
        assert returned is module.bias  # megatron adds it later (bias-dropout-add)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_traceable_layernorm_linear_is_norm_then_gemm(normalization, zero_centered):
    torch.manual_seed(0)
    module = StandInLayerNormLinear(
        32, 24, normalization=normalization, zero_centered_gamma=zero_centered
    )
    x = torch.randn(6, 2, 32) * 3
    out, returned = attention_block.traceable_layernorm_linear(module, x)
    torch.testing.assert_close(out, module._reference(x), rtol=1e-5, atol=1e-5)
    assert returned is None


def _substituted(kind, stand_in):
    """``stand_in`` with its forward wrapped by the patch's factory (the patches wrap megatron's
    classes' ``forward`` in place; a subclass here keeps the stand-in itself unpatched)."""
    factory = {
        "linear": attention_block._te_linear_factory,
        "layernorm_linear": attention_block._te_layernorm_linear_factory,
        "attention": attention_block._te_attention_factory,
    }[kind]
    forward = factory(stand_in.forward)
    assert forward.__wrapped__ is stand_in.forward and forward.__name__ == "forward"
    return type(stand_in.__name__, (stand_in,), {"forward": forward})


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear"])
def test_linear_substitute_traces_inside_compiled_layers_only(
    kind, fresh_dynamo, in_compiled_layer
):
    torch.manual_seed(0)
    stand_in = StandInLinear if kind == "linear" else StandInLayerNormLinear
    module = _substituted(kind, stand_in)(16, 8)
    x = torch.randn(4, 2, 16, requires_grad=True)

    eager, _ = module(x)
    assert module.calls == 1
    compiled = torch.compile(lambda t: module(t)[0] * 2, backend="aot_eager")(x)
    assert module.calls == 1 and breaks(fresh_dynamo) == 0
    torch.testing.assert_close(compiled, eager * 2, rtol=1e-5, atol=1e-5)
    compiled.sum().backward()
    assert (
        module.weight.grad is not None and x.grad is not None
    )  # DDP's hooks add .grad to main_grad

    tracing.IN_COMPILED_LAYER[0] = False  # other torch.compile'd code keeps TE
    torch.compile(lambda t: module(t)[0] + 1, backend="aot_eager")(x)
    assert module.calls == 2
    tracing.IN_COMPILED_LAYER[0] = True


@pytest.mark.parametrize(
    "attrs",
    [
        {"tp_size": 2},
        {"fuse_wgrad_accumulation": True},
        {"weight_names": ["query_weight", "key_weight"]},
        {"te_quant_params": object()},
        {"config": _config(fp8="hybrid")},
        {"config": _config(delay_wgrad_compute=True)},
    ],
)
def test_linear_substitute_leaves_other_cases_to_te(attrs, fresh_dynamo, in_compiled_layer):
    module = _substituted("linear", StandInLinear)(16, 8, **attrs)
    assert not attention_block.plain_bf16_linear(module)
    torch.compile(lambda t: module(t)[0] * 2, backend="aot_eager")(torch.randn(3, 16))
    assert module.calls == 1 and breaks(fresh_dynamo) >= 1


@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 4)])
def test_traceable_attention_is_causal_softmax_attention(heads, groups):
    torch.manual_seed(0)
    q = torch.randn(12, 2, heads, 16, requires_grad=True)
    k = torch.randn(12, 2, groups, 16, requires_grad=True)
    v = torch.randn(12, 2, groups, 16, requires_grad=True)
    for causal in (True, False):
        out = attention_block.traceable_attention(q, k, v, causal, 0.3)
        ref = reference_attention(q, k, v, causal, 0.3)
        assert out.shape == (12, 2, heads * 16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _qkv():
    torch.manual_seed(0)
    return torch.randn(10, 2, 8, 16), torch.randn(10, 2, 2, 16), torch.randn(10, 2, 2, 16)


def test_attention_substitute_traces_plain_causal_attention(fresh_dynamo, in_compiled_layer):
    module = _substituted("attention", StandInAttention)()
    q, k, v = _qkv()
    eager = module(q, k, v, None, Mask("causal"))
    assert module.calls == 1
    compiled = torch.compile(lambda *t: module(*t, None, Mask("causal")) + 1, backend="aot_eager")(
        q, k, v
    )
    assert module.calls == 1 and breaks(fresh_dynamo) == 0
    torch.testing.assert_close(compiled, eager + 1, rtol=1e-5, atol=1e-5)


class _Group:
    def size(self):
        return 2


@pytest.mark.parametrize(
    "attrs,call",
    [
        ({"attention_dropout": 0.1}, {}),
        ({"window_size": (128, 0)}, {}),
        ({"qkv_format": "thd"}, {}),
        ({"cp_group": _Group()}, {}),
        ({"deterministic": True}, {}),
        ({"softmax_type": "learnable"}, {}),
        ({"config": _config(fp8="e4m3")}, {}),
        ({"config": _config(qk_clip=True)}, {}),
        ({}, {"attention_bias": torch.zeros(1)}),
        ({}, {"packed_seq_params": object()}),
        ({}, {"mask": "padding_causal"}),
        ({}, {"mask": "no_mask", "attention_mask": torch.ones(1, dtype=torch.bool)}),
        ({"cp_group": [object(), object()]}, {}),  # hierarchical CP (a2a+p2p): a list of groups
        ({"num_splits": 2}, {}),
        ({}, {"num_splits": 2}),
        ({"softcap": 30.0}, {}),
        ({"return_max_logit": True}, {}),
        ({}, {"key_len": 6}),  # fewer keys than queries (decode-style): TE's bottom-right alignment
        ({}, {"value_dim": 8}),  # a value head dim other than the query's (MLA)
    ],
)
def test_attention_substitute_leaves_other_cases_to_te(
    attrs, call, fresh_dynamo, in_compiled_layer
):
    module = _substituted("attention", StandInAttention)(**attrs)
    q, k, v = _qkv()
    call = dict(call)
    mask = Mask(call.pop("mask", "causal"))
    attention_mask = call.pop("attention_mask", None)
    if "key_len" in call:
        k, v = k[: call["key_len"]], v[: call.pop("key_len")]
    if "value_dim" in call:
        v = v[..., : call.pop("value_dim")]
    assert not attention_block.sdpa_eligible(module, q, k, v, attention_mask, mask, **call)
    try:
        torch.compile(lambda *t: module(*t, attention_mask, mask, **call), backend="aot_eager")(
            q, k, v
        )
    except (
        Exception
    ):  # the stand-in "kernel" itself may refuse the shapes: it was called, which is the point
        pass
    assert module.calls == 1


def test_attention_dropout_is_fine_outside_training():
    module = StandInAttention(attention_dropout=0.1)
    q, k, v = _qkv()
    module.eval()
    assert attention_block.sdpa_eligible(module, q, k, v, None, Mask("causal"))
    module.train()
    assert not attention_block.sdpa_eligible(module, q, k, v, None, Mask("causal"))


def test_substitutes_need_transformer_engine_classes():
    """Without TE megatron's names are placeholders (mocks), not functions: a clear error."""
    from unittest import mock

    with pytest.raises(
        registry.PatchsetError,
        match="TEDotProductAttention.forward.*not a function.*TransformerEngine is not installed",
    ):
        attention_block._te_attention_factory(mock.MagicMock())
    with pytest.raises(
        registry.PatchsetError, match="TELinear.forward.*--compile-transformer-layers-te-kernels"
    ):
        attention_block._te_linear_factory(None)


def test_fp8_autocast_or_cpu_offload_keeps_te(fresh_dynamo, in_compiled_layer, monkeypatch):
    """compile_layer's wrapper reads TE's FP8-autocast and CPU-offload state before each call; the
    traced code keeps TE's forward when either is on."""
    assert tracing.te_context_plain()  # no TE here: nothing enabled
    monkeypatch.setattr(tracing, "_te_context_checks", lambda: (lambda: False, lambda: True))
    assert not tracing.te_context_plain()
    module = _substituted("linear", StandInLinear)(16, 8)
    tracing.TE_CONTEXT_PLAIN[0] = False
    try:
        torch.compile(lambda t: module(t)[0] * 2, backend="aot_eager")(torch.randn(3, 16))
    finally:
        tracing.TE_CONTEXT_PLAIN[0] = True
    assert module.calls == 1 and breaks(fresh_dynamo) >= 1


def test_compiled_layer_wrapper_sets_the_te_context_flag(monkeypatch):
    seen = []
    monkeypatch.setattr(tracing, "te_context_plain", lambda: False)
    layer = torch.nn.Linear(4, 4)
    layer.forward = lambda x: seen.append(tracing.TE_CONTEXT_PLAIN[0]) or x
    layers.compile_layer(layer, compile_flags.CompileOptions(backend="eager"), None)
    try:
        layer.forward(torch.randn(2, 4))
    finally:
        tracing.TE_CONTEXT_PLAIN[0] = True
    assert seen == [False]


def test_attention_block_report_counts_traceable_modules(monkeypatch):
    linear_cls = _substituted("linear", StandInLinear)
    attention_cls = _substituted("attention", StandInAttention)
    names = {
        linear_cls.forward: "torch_compile.te_linear_traceable",
        attention_cls.forward: "torch_compile.te_attention_traceable",
    }
    monkeypatch.setattr(attention_block, "patched_by", lambda obj: names.get(obj))
    model = torch.nn.ModuleList(
        [
            linear_cls(4, 4),
            linear_cls(4, 4, fuse_wgrad_accumulation=True),
            attention_cls(),
            attention_cls(attention_dropout=0.1),
            torch.nn.Linear(2, 2),
        ]
    )
    report = attention_block.attention_block_report([model])
    assert report.startswith("TE linears 1 of 2, TE attentions 1 of 2 trace as torch ops")
    assert "--no-gradient-accumulation-fusion" in report and "attention dropout" in report
