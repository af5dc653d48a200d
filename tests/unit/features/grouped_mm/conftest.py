"""Shared cases of the grouped-GEMM tests: per-expert row counts with empty experts, weights, a
per-expert matmul reference, and a fake TE grouped linear. PyTorch's grouped_mm has a CPU
fallback for bf16 (the same operator and layouts as on the GPU), so arithmetic, offsets and the
gradient plumbing are checked on the CPU; tests/gpu/features/grouped_mm/ compares with TE."""

import pytest
import torch

from megatron.patchset.features.grouped_mm import linears
from megatron.patchset.features.grouped_mm import torch_grouped_gemm as tgg

IN, OUT = 32, 16


# Row counts per expert, with empty experts at the start, in the middle and at the end.
SPLITS = [0, 5, 3, 0, 9, 1, 0]


def expert_weights(n=None, requires_grad=True, seed=0, shape=(OUT, IN)):
    n = len(SPLITS) if n is None else n
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_(requires_grad)
        for _ in range(n)
    ]


def ddp_main_grads(weights, descending=True, dtype=torch.float32, fill=0.5):
    """Main grads laid out as megatron's DDP buffer holds them: back to back, expert ``e`` at index
    ``n - 1 - e`` when ``descending``; returns the buffer."""
    buffer = torch.full((len(weights), OUT, IN), fill, dtype=dtype)
    for i, w in enumerate(weights):
        w.main_grad = buffer[len(weights) - 1 - i] if descending else buffer[i]
        w.grad_added_to_main_grad = False
    return buffer


def rows(m, width=IN, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, width, generator=gen).to(torch.bfloat16)


class FakeTEGroupedLinear(torch.nn.Module):
    """The attributes of megatron's TE grouped linear that the mixin reads."""

    def __init__(self, num_gemms, input_size, output_size, config=None, **_):
        super().__init__()
        self.config = config  # TE's grouped linear keeps megatron's TransformerConfig
        self.num_gemms = num_gemms
        self.is_first_microbatch = True
        for i, w in enumerate(expert_weights(num_gemms, shape=(output_size, input_size))):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w.detach().clone()))

    def forward(self, x, m_splits):
        raise AssertionError("the TE forward must not run")


def grouped_mlp(splits):
    from types import SimpleNamespace

    import torch.nn.functional as F
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=4,
        num_moe_experts=len(splits),
        moe_ffn_hidden_size=OUT,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        moe_grouped_gemm=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    submodules = GroupedMLPSubmodules(
        linear_fc1=linears.grouped_mm_linear(FakeTEGroupedLinear, "Column"),
        linear_fc2=linears.grouped_mm_linear(FakeTEGroupedLinear, "Row"),
    )
    return TEGroupedMLP(
        len(splits), config, submodules, pg_collection=SimpleNamespace(ep=None, expt_tp=None)
    )


@pytest.fixture(autouse=True)
def fresh_caches():
    for cache in (tgg._offsets_cache, tgg._fp32_wgrad_supported):
        cache.clear()
    yield
    tgg._offsets_cache.clear()


def tiny_parsed(*extra):
    from tests.unit.conftest import parse, tiny_argv

    return parse(tiny_argv(*extra))
