# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe import torch_grouped_gemm
from megatron.core.transformer.transformer_config import TransformerConfig

IN, OUT = 32, 16
# Row counts per expert, with empty experts at the start, in the middle and at the end.
SPLITS = [0, 5, 3, 0, 9, 1, 0]

requires_grouped_mm = pytest.mark.skipif(
    not hasattr(F, "grouped_mm"), reason="torch.nn.functional.grouped_mm requires torch >= 2.9"
)


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(OUT, IN, generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in SPLITS
    ]


def _rows(m, width=IN, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen).to(torch.bfloat16)


def _reference(x, weights, dy):
    """Per-expert fp32 matmuls: output, input gradient, weight gradients."""
    outs, dxs, dws, start = [], [], [], 0
    for n, w in zip(SPLITS, weights):
        xe, dye, we = x[start : start + n].float(), dy[start : start + n].float(), w.float()
        outs.append(xe @ we.t())
        dxs.append(dye @ we)
        dws.append(dye.t() @ xe)
        start += n
    return torch.cat(outs), torch.cat(dxs), dws


def _close(actual, expected):
    expected = expected.float()
    tolerance = 0.01 * expected.abs().max().item() + 1e-6
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=0)


@pytest.fixture(autouse=True)
def _fresh_caches():
    torch_grouped_gemm._offsets_cache.clear()
    torch_grouped_gemm._fp32_wgrad_supported.clear()
    yield
    torch_grouped_gemm._offsets_cache.clear()


@requires_grouped_mm
class TestTorchGroupedGemm:
    @pytest.mark.parametrize("as_tensor", [False, True])
    def test_forward_and_gradients_match_per_expert_matmuls(self, as_tensor):
        weights = _weights()
        x = _rows(sum(SPLITS)).requires_grad_(True)
        dy = _rows(sum(SPLITS), OUT, seed=2)
        splits = torch.tensor(SPLITS) if as_tensor else SPLITS
        out = torch_grouped_gemm.grouped_mm(x, splits, weights)
        out.backward(dy)
        ref_out, ref_dx, ref_dws = _reference(x.detach(), [w.detach() for w in weights], dy)
        _close(out, ref_out)
        _close(x.grad, ref_dx)
        for w, ref_dw in zip(weights, ref_dws):
            _close(w.grad, ref_dw)

    def test_offsets_are_int32_and_shared_by_equal_host_splits(self):
        offs = torch_grouped_gemm.group_offsets(SPLITS, torch.device("cpu"))
        assert offs.dtype == torch.int32 and offs.tolist() == [0, 5, 8, 8, 17, 18, 18]
        assert torch_grouped_gemm.group_offsets(list(SPLITS), torch.device("cpu")) is offs
        on_device = torch_grouped_gemm.group_offsets(torch.tensor(SPLITS), torch.device("cpu"))
        assert on_device.tolist() == offs.tolist()

    @pytest.mark.parametrize("descending", [True, False])
    def test_weight_gradients_go_into_the_main_grads(self, descending):
        """megatron's DDP places a layer's expert main grads back to back in reverse order."""
        weights = _weights()
        buffer = torch.full((len(weights), OUT, IN), 0.5)
        for i, w in enumerate(weights):
            w.main_grad = buffer[len(weights) - 1 - i] if descending else buffer[i]
            w.grad_added_to_main_grad = False
        x = _rows(sum(SPLITS))
        dy = _rows(sum(SPLITS), OUT, seed=2)
        out = torch_grouped_gemm.grouped_mm(x, SPLITS, weights, fuse_accumulation=True)
        out.backward(dy)
        _, _, ref_dws = _reference(x, [w.detach() for w in weights], dy)
        for w, ref_dw in zip(weights, ref_dws):
            _close(w.main_grad - 0.5, ref_dw)
            assert w.grad_added_to_main_grad is True
            assert w.grad is not None and w.grad.shape == w.shape  # DDP's hook still fires

    def test_no_rows(self):
        weights = _weights()
        x = _rows(0).requires_grad_(True)
        out = torch_grouped_gemm.grouped_mm(x, [0] * len(weights), weights)
        assert out.shape == (0, OUT)
        out.backward(torch.empty(0, OUT, dtype=torch.bfloat16))
        assert x.grad.shape == (0, IN)
        assert all(torch.count_nonzero(w.grad) == 0 for w in weights)

    def test_grouped_linear_forward_reads_the_weights_from_one_storage(self):
        module = torch.nn.Module()
        module.num_gemms = len(SPLITS)
        module.is_first_microbatch = True
        for i, w in enumerate(_weights()):
            module.register_parameter(f"weight{i}", torch.nn.Parameter(w.detach().clone()))
        values = [p.detach().clone() for p in module.parameters()]
        x = _rows(sum(SPLITS))
        out, bias = torch_grouped_gemm.grouped_linear_forward(module, x, torch.tensor(SPLITS))
        assert bias is None and module.is_first_microbatch is False
        _close(out, _reference(x, values, torch.zeros(sum(SPLITS), OUT))[0])
        weights = list(module.parameters())
        storage = weights[0].untyped_storage().data_ptr()
        assert all(w.untyped_storage().data_ptr() == storage for w in weights)
        assert all(torch.equal(w, v) for w, v in zip(weights, values))

    def test_fp32_inputs_are_refused(self):
        module = torch.nn.Module()
        with pytest.raises(RuntimeError, match="bf16"):
            torch_grouped_gemm.grouped_linear_forward(module, torch.zeros(2, IN), [2])


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel runs on a GPU or under TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("overwrite", [False, True])
def test_add_reversed_is_torchs_promoted_add(overwrite):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_grouped_gemm._add_reversed_kernel.cache_clear()
    gen = torch.Generator().manual_seed(0)
    shape = (5, 7, torch_grouped_gemm.ADD_REVERSED_BLOCK // 3)
    stack = torch.randn(*shape, generator=gen).to(device)
    dw = torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)
    expected = dw.flip(0).float() if overwrite else stack + dw.flip(0)
    torch_grouped_gemm.add_reversed(stack, dw, overwrite=overwrite)
    assert torch.equal(stack, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TEGroupedLinear needs a GPU")
def test_te_grouped_linear_routes_to_the_torch_grouped_gemm():
    pytest.importorskip("transformer_engine")
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel(1, 1)
    try:
        config = _config(moe_grouped_gemm_impl="torch")
        linear = TEColumnParallelGroupedLinear(
            len(SPLITS),
            IN,
            OUT,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=False,
            skip_bias_add=False,
            is_expert=True,
            tp_comm_buffer_name="fc1",
        ).cuda()
        x = _rows(sum(SPLITS)).cuda()
        out, bias = linear(x, torch.tensor(SPLITS, device="cuda"))
        weights = [getattr(linear, f"weight{i}").detach() for i in range(len(SPLITS))]
        ref_out = _reference(x, weights, torch.zeros(sum(SPLITS), OUT, device="cuda"))[0]
        assert bias is None
        _close(out, ref_out)
    finally:
        Utils.destroy_model_parallel()


def _config(**kwargs):
    options = dict(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=4,
        num_moe_experts=len(SPLITS),
        moe_ffn_hidden_size=OUT,
        moe_grouped_gemm=True,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return TransformerConfig(**{**options, **kwargs})


class TestTorchGroupedGemmConfig:
    def test_defaults_keep_te(self):
        config = _config()
        assert config.moe_grouped_gemm_impl == "te" and not config.moe_expert_splits_on_device

    def test_torch_impl_and_device_splits_are_accepted(self):
        pytest.importorskip("transformer_engine")  # moe_permute_fusion needs TE's permutation
        config = _config(
            moe_grouped_gemm_impl="torch",
            moe_expert_splits_on_device=True,
            moe_token_dispatcher_type="alltoall",
            moe_permute_fusion=True,
        )
        assert config.moe_expert_splits_on_device

    @pytest.mark.parametrize(
        "options, message",
        [
            (dict(add_bias_linear=True), "add_bias_linear=False"),
            (dict(bf16=False, params_dtype=torch.float32), "bf16"),
            (dict(moe_grouped_gemm=False), "moe_grouped_gemm=True"),
            (dict(moe_ffn_hidden_size=20), "multiples of 8"),
            (dict(cuda_graph_impl="full_iteration"), "moe_expert_splits_on_device=True"),
        ],
    )
    def test_torch_impl_refuses(self, options, message):
        with pytest.raises(ValueError, match=message):
            _config(moe_grouped_gemm_impl="torch", **options)

    @pytest.mark.parametrize(
        "options, message",
        [
            (dict(moe_grouped_gemm_impl="te"), "moe_grouped_gemm_impl='torch'"),
            (dict(moe_token_dispatcher_type="allgather"), "alltoall"),
            (dict(moe_permute_fusion=False), "moe_permute_fusion"),
            (dict(expert_model_parallel_size=2), "expert_model_parallel_size=1"),
            (dict(moe_expert_capacity_factor=1.0), "no token dropping"),
        ],
    )
    def test_device_splits_refuse(self, options, message):
        base = dict(
            moe_grouped_gemm_impl="torch",
            moe_expert_splits_on_device=True,
            moe_token_dispatcher_type="alltoall",
            moe_permute_fusion=True,
        )
        with pytest.raises(ValueError, match=message):
            _config(**{**base, **options})
