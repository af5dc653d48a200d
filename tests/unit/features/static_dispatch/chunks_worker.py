"""One process of the chunked-MoE-layer comparison (gloo): megatron's ``MoELayer`` (local spec,
router with its auxiliary loss) with the static dispatcher, run whole and in token chunks
(``--moe-static-dispatch-chunks``) on the same input, forward and backward. Results go to
``<out>.rank<r>.pt``."""

import os

import pytest
import torch

from tests.unit.features.static_dispatch.exchange import Experts, H, moe_config

EXPERTS, SEQ, BATCH = 4, 12, 2
PATCHES = ("static_dispatch.dispatcher", "static_dispatch.chunks")


class LayerExperts(Experts):
    """The reference experts as the MoE layer calls them: ``(output, bias)``."""

    calls = 0

    def forward(self, x, tokens_per_expert, probs):
        LayerExperts.calls += 1
        return super().forward(x, tokens_per_expert, probs), None


def worker(rank, world_size, port, dtype_name, chunk_counts, out, dedup=False):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.patchset.core import registry
    from megatron.patchset.features.static_dispatch import flags
    from tests.unit.support import cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    mp = pytest.MonkeyPatch()
    cpu_shims.install(mp)
    registry.apply_patches([registry.get(n) for n in PATCHES], check=False)
    dtype = getattr(torch, dtype_name)
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        local = EXPERTS // world_size
        config = moe_config(
            EXPERTS,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            params_dtype=dtype,
        )
        setattr(config, flags.CONFIG_ON, True)
        setattr(config, flags.CONFIG_FACTOR, 2.0)
        setattr(config, flags.CONFIG_DEDUP, dedup)
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(3)
        layer = spec.submodules.mlp(config=config, pg_collection=pg)
        layer.experts = LayerExperts(ep_rank * local, local, dtype)
        gen = torch.Generator().manual_seed(70 + rank)
        hidden = torch.randn(SEQ, BATCH, H, generator=gen, dtype=dtype)
        grad_out = torch.randn(SEQ, BATCH, H, generator=gen, dtype=dtype)

        result = {"dispatcher": type(layer.token_dispatcher).__name__}
        for n in chunk_counts:
            setattr(config, flags.CONFIG_CHUNKS, n)
            layer.zero_grad(set_to_none=True)
            LayerExperts.calls = 0
            x = hidden.clone().requires_grad_(True)
            output, bias = layer(x)
            (output * grad_out).sum().backward()
            result[n] = {
                "out": output.detach(),
                "bias": bias,
                "hidden_grad": x.grad,
                "grads": {
                    name: p.grad.clone()
                    for name, p in layer.named_parameters()
                    if p.grad is not None
                },
                "expert_calls": LayerExperts.calls,
            }
        torch.save(result, f"{out}.rank{rank}.pt")
    finally:
        registry.revert(PATCHES)
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        mp.undo()
