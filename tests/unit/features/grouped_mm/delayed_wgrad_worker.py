"""One process of the delayed weight-gradient comparison (gloo): megatron's ``MoELayer`` with its
all-to-all dispatcher and ``TEGroupedMLP`` experts on the torch grouped-GEMM linears, forward and
backward with and without ``--overlap-dispatch-backward-with-experts-wgrad`` on the same input.
Results go to ``<out>.rank<r>.pt``."""

import os
from types import SimpleNamespace

import pytest
import torch

EXPERTS, SEQ, BATCH = 4, 8, 2


def worker(rank, world_size, port, out):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    from megatron.patchset.features.grouped_mm import linears
    from tests.unit.features.grouped_mm.conftest import FakeTEGroupedLinear
    from tests.unit.features.static_dispatch.exchange import H, moe_config
    from tests.unit.support import cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    mp = pytest.MonkeyPatch()
    cpu_shims.install(mp)
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
        config = moe_config(
            EXPERTS,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            bias_activation_fusion=False,
            moe_grouped_gemm=True,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
        spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        submodules = GroupedMLPSubmodules(
            linear_fc1=linears.grouped_mm_linear(FakeTEGroupedLinear, "Column"),
            linear_fc2=linears.grouped_mm_linear(FakeTEGroupedLinear, "Row"),
        )

        def build():
            """The same layer each time: the router from the seed, the experts' weights from
            the fake linear's fixed seed."""
            config.overlap_dispatch_backward_with_experts_wgrad = True  # its stream and event
            torch.manual_seed(3)
            layer = spec.submodules.mlp(config=config, pg_collection=pg).to(torch.bfloat16)
            layer.experts = TEGroupedMLP(
                EXPERTS // world_size,
                config,
                submodules,
                pg_collection=SimpleNamespace(ep=None, expt_tp=None),
            )
            return layer

        gen = torch.Generator().manual_seed(70 + rank)
        hidden = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)
        grad_out = torch.randn(SEQ, BATCH, H, generator=gen).to(torch.bfloat16)

        result = {}
        for delayed in (False, True):
            run = build()
            # Set after the config's checks, which ask for TransformerEngine 2.3 or later; the
            # layer reads it at each call.
            config.overlap_dispatch_backward_with_experts_wgrad = delayed
            for linear in (run.experts.linear_fc1, run.experts.linear_fc2):
                linear.delay_wgrad_compute = delayed
            calls = []

            def counted(*a, original=run.backward_dw, calls=calls, **k):
                calls.append(k)
                return original(*a, **k)

            run.backward_dw = counted
            for _ in range(2):  # two micro-batches accumulate
                x = hidden.clone().requires_grad_(True)
                output, _ = run(x)
                (output.float() * grad_out.float()).sum().backward()
            result[delayed] = {
                "out": output.detach(),
                "hidden_grad": x.grad,
                "grads": {
                    n: p.grad.clone() for n, p in run.named_parameters() if p.grad is not None
                },
                "backward_dw_calls": calls,
                "pending": [
                    len(getattr(linear, "_patchset_pending_wgrads", []))
                    for linear in (run.experts.linear_fc1, run.experts.linear_fc2)
                ],
            }
        torch.save(result, f"{out}.rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        mp.undo()
