"""One process of the two-process comparison (gloo): megatron's all-to-all dispatcher and the
static one on the same routing, through dispatch, a reference expert computation and combine,
forward and backward. Results go to ``<out>.rank<r>.pt`` for the test to compare."""

import os

import pytest
import torch

H, TOKENS, TOPK = 16, 12, 2

# Routing cases: the experts each token picks, as a rule of (rank, token) -> expert scores.
CASES = ("uneven", "one rank receives nothing", "all experts on one rank", "overflow")


def routing(case, rank, experts, seed):
    gen = torch.Generator().manual_seed(seed + 101 * rank)
    scores = torch.rand(TOKENS, experts, generator=gen)
    if case == "uneven":
        scores[:, 0] += 0.6 * (rank + 1)  # expert 0 popular, more so on rank 1
    elif case == "one rank receives nothing":
        scores[:, experts // 2 :] -= 2.0  # the second half of the experts (rank 1's) gets none
    elif case == "overflow":
        scores[:, 1] += 2.0  # every token picks expert 1 (rank 0 gets twice its balanced share)
    chosen = scores.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(TOKENS, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(TOKENS, experts, generator=gen) * routing_map
    return routing_map, probs


class Experts(torch.nn.Module):
    """One (H x H) weight per local expert; ``y = (x @ W_e) * prob`` on each expert's rows, read
    with host counts (a reference, not the grouped GEMM)."""

    def __init__(self, first, count, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        weights = [torch.randn(H, H, generator=gen, dtype=dtype) for _ in range(first + count)]
        self.w = torch.nn.ParameterList(weights[first:])

    def forward(self, x, tokens_per_expert, probs):
        counts = getattr(tokens_per_expert, "counts", tokens_per_expert)
        counts = torch.as_tensor(counts).tolist()
        out, start = [], 0
        for w, n in zip(self.w, counts):
            out.append(x[start : start + n] @ w * probs[start : start + n, None])
            start += n
        out.append(x[start:] * 0)  # padding rows (static buffers) stay zero
        return torch.cat(out)


def moe_config(experts, **extra):
    """A one-layer MoE ``TransformerConfig`` of hidden size H, top-TOPK, the alltoall dispatcher,
    on the CPU (megatron's warnings about the missing GPU packages silenced)."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=4,
            num_moe_experts=experts,
            moe_router_topk=TOPK,
            moe_token_dispatcher_type="alltoall",
            use_cpu_initialization=True,
            moe_ffn_hidden_size=H,
            **extra,
        )


def run_layer(dispatcher, experts, hidden, routing_map, probs, grad_out):
    h = hidden.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    tokens, pp = dispatcher.dispatch_preprocess(h, routing_map, p)
    tokens, pp = dispatcher.token_dispatch(tokens, pp)
    x, tokens_per_expert, pp = dispatcher.dispatch_postprocess(tokens, pp)
    y = experts(x, tokens_per_expert, pp)
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))
    (out * grad_out).sum().backward()
    counts = getattr(tokens_per_expert, "counts", tokens_per_expert)
    total = int(torch.as_tensor(counts).sum())
    return {
        "rows": x[:total].detach(),
        "tail": x[total:].detach(),
        "probs": pp[:total].detach(),
        "expert_out": y[:total].detach(),
        "out": out.detach(),
        "hidden_grad": h.grad,
        "probs_grad": p.grad,
        "weight_grads": [w.grad.clone() for w in experts.w],
        "tokens_per_expert": torch.as_tensor(counts).clone(),
    }


def worker(rank, world_size, port, case, dtype_name, factor, out, emulated=None):
    """One rank of the comparison. ``emulated="alike"``: every rank takes rank 0's routing and
    activations (a real exchange among ranks that route alike); ``emulated="fake"``: this one
    process is rank ``rank`` of ``world_size`` under megatron's fake process group with the
    fork's stand-ins for the expert-parallel exchanges, on rank 0's inputs."""

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.patchset.features.static_dispatch import dispatcher as dispatcher_module
    from megatron.patchset.features.static_dispatch import flags, runner, state
    from megatron.patchset.features.static_dispatch.dispatcher import static_dispatcher
    from tests.unit.support import cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fake = emulated == "fake"
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from megatron.patchset.core import registry

        torch.distributed.init_process_group(
            "fake", store=FakeStore(), rank=rank, world_size=world_size
        )
        names = ("compat.fake_group_ep_all_to_all", "compat.fake_group_ep_all_gather")
        registry.apply_patches([registry.get(n) for n in names], check=False)
    else:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    inputs = 0 if emulated else rank  # whose routing and activations this rank takes
    mp = pytest.MonkeyPatch()
    cpu_shims.install(mp)
    dtype = getattr(torch, dtype_name)
    ep = 1 if case == "all experts on one rank" else world_size
    experts_total = 4
    local = experts_total // ep
    try:
        parallel_state.initialize_model_parallel(
            expert_model_parallel_size=ep, create_gloo_process_groups=not fake
        )
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        config = moe_config(experts_total)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        indices = list(range(ep_rank * local, (ep_rank + 1) * local))
        upstream = MoEAlltoAllTokenDispatcher(local, indices, config, pg_collection=pg)
        static_config = TransformerConfig(**{**config.__dict__})
        setattr(static_config, flags.CONFIG_ON, True)
        setattr(static_config, flags.CONFIG_FACTOR, factor)
        static = static_dispatcher(MoEAlltoAllTokenDispatcher)(
            local, indices, static_config, pg_collection=pg
        )
        dedup_config = TransformerConfig(**{**config.__dict__})
        for name, value in (
            (flags.CONFIG_ON, True),
            (flags.CONFIG_FACTOR, factor),
            (flags.CONFIG_DEDUP, True),
        ):
            setattr(dedup_config, name, value)
        dedup = static_dispatcher(MoEAlltoAllTokenDispatcher)(
            local, indices, dedup_config, pg_collection=pg
        )
        routing_map, probs = routing(case, inputs, experts_total, seed=11)
        gen = torch.Generator().manual_seed(40 + inputs)
        hidden = torch.randn(TOKENS, H, generator=gen, dtype=dtype)
        grad_out = torch.randn(TOKENS, H, generator=gen, dtype=dtype)
        probs = probs.to(dtype)

        result = {"ep": ep}
        for name, dispatcher in (("upstream", upstream), ("static", static), ("dedup", dedup)):
            state.reset()
            experts = Experts(ep_rank * local, local, dtype)
            result[name] = run_layer(dispatcher, experts, hidden, routing_map, probs, grad_out)
            result[name]["overflow"] = state.overflowed()

        result["dedup_announced"] = dispatcher_module._announced

        # The step runner on an overflowing step: the static attempt is discarded and re-run
        # with megatron's dynamic path (rerun), or the step stops (fail).
        for prefix, dispatcher in (("", static), ("dedup_", dedup)):
            for policy in flags.ON_OVERFLOW:
                state.ON_OVERFLOW = policy
                experts = Experts(ep_rank * local, local, dtype)

                def attempt(data_iterator, model, dispatcher=dispatcher, **_):
                    run_layer(dispatcher, model[0], *next(data_iterator), grad_out)
                    return [{"attempt_static": state.static()}]

                data = runner.hold(iter([(hidden, routing_map, probs)]), 1)
                step = {"data_iterator": data, "model": [experts]}
                try:
                    ran = runner.run_step(attempt, attempt, step)
                    result[f"{prefix}step_{policy}"] = {
                        "ran_static": ran[0]["attempt_static"],
                        "weight_grads": [w.grad.clone() for w in experts.w],
                    }
                except runner.StaticDispatchOverflow as error:
                    result[f"{prefix}step_{policy}"] = {"error": str(error)}
        state.ON_OVERFLOW = "rerun"
        torch.save(result, f"{out}.rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        mp.undo()
        if fake:
            registry.revert(names)


def emulated_worker(_index, rank, *args):
    """``worker`` as rank ``rank`` in a process of its own (torch's spawn passes the index)."""
    worker(rank, *args)
