"""The model's shape and precision: what megatron asserts without a message, or not at all."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule


@rule(
    "attention-heads-fit-hidden-size",
    phase="layout",
    flags=("--hidden-size", "--num-attention-heads", "--kv-channels", "--num-query-groups"),
)
def _attention_heads(args):
    """Without --kv-channels each head is hidden / heads wide; query groups split the heads."""
    problems = []
    heads = args.num_attention_heads
    if args.kv_channels is None and heads and args.hidden_size % heads:
        problems.append(
            f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads {heads} "
            "(set --kv-channels for heads of another width, or change either)"
        )
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    if groups and heads and (groups > heads or heads % groups):
        problems.append(
            f"--num-query-groups {groups} does not divide --num-attention-heads {heads} (each "
            "group shares its key and value among heads / groups query heads)"
        )
    return listed("", problems)


@rule("moe-router-topk-fits-experts", phase="layout", flags=("--moe-router-topk", "--num-experts"))
def _router_topk(args):
    """A token is routed to top-k distinct experts."""
    experts, topk = args.num_experts, args.moe_router_topk
    if experts and topk > experts:
        return (
            f"--moe-router-topk {topk} is more than --num-experts {experts}: each token is routed "
            "to k distinct experts. Use a top-k of at most the number of experts."
        )
    return None


@rule("one-precision", phase="layout", flags=("--fp16", "--bf16"))
def _one_precision(args):
    """megatron asserts (without a message) that --fp16 and --bf16 are not both set."""
    if args.fp16 and args.bf16:
        return (
            "--fp16 and --bf16 are both set (a flag file and the command line may each give one): "
            "keep one."
        )
    return None
