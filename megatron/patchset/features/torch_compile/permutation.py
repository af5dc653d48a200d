"""The all-to-all dispatcher's permutation as gathers while compiling.

With --moe-permute-fusion, permutation 1 (before the all-to-all) and its inverse (after it)
are TE's mask-map kernels: Triton launches made from Python inside a custom op, on the host path
of every compiled layer's forward and backward. In dropless routing each token has exactly k
experts, so both directions are gathers of static shape that inductor fuses into the layer's
graphs: permute gathers each (expert, token) pair's row in megatron's order (expert-major,
tokens ascending; the order of upstream's unfused argsort permute and of TE's kernel), and its
gradient sums each token's k rows in fp32; unpermute sums each token's k rows in fp32 (as TE's
unpermute accumulates) and its gradient gathers. Deterministic: no atomics, unlike upstream's
unfused path (index_add / scatter_add in the tokens' dtype).
"""

from __future__ import annotations

import functools

from megatron.patchset.core.errors import PatchsetError
from megatron.patchset.core.registry import patch
from megatron.patchset.features.torch_compile.flags import FLAG, traceable_permutation
from megatron.patchset.features.torch_compile.tracing import PERMUTE_TOPK, tracing

_TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def permutation_topk(dispatcher) -> int | None:
    """The router's k when every token of ``dispatcher`` routes to exactly k experts and its
    permutation is TE's fused one: the all-to-all dispatcher with --moe-permute-fusion, dropless
    (no capacity factor, no padding to capacity) and no routing-map padding for FP8/FP4."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        return None
    config = dispatcher.config
    if (
        not config.moe_permute_fusion
        or config.moe_expert_capacity_factor is not None
        or config.moe_pad_expert_input_to_capacity
        or config.moe_router_padding_for_quantization
    ):
        return None
    return int(config.moe_router_topk)


def permutation_maps(routing_map, num_out_tokens: int):
    """``(flat_order, token_of_row)``: the positions in ``routing_map.T`` (flattened, expert-major)
    of the routed pairs in permuted order, and the token of every permuted row."""
    import torch

    num_tokens = routing_map.shape[0]
    flat_order = torch.argsort(routing_map.T.reshape(-1), descending=True, stable=True)[
        :num_out_tokens
    ]
    return flat_order, torch.remainder(flat_order, num_tokens)


def rows_of_tokens(token_of_row, num_tokens: int, topk: int):
    """``[tokens, k]``: the permuted rows of every token (ascending, i.e. by expert)."""
    import torch

    return torch.argsort(token_of_row, stable=True).view(num_tokens, topk)


def _sum_rows(rows, rows_of_token):
    """``out[t] = sum_j rows[rows_of_token[t, j]]``, accumulated in fp32 (or wider)."""
    import torch

    # Casts only where the dtype changes: under dynamo an autograd function whose output went
    # through a same-dtype .to() got a zero gradient (torch 2.11).
    accumulate = torch.promote_types(rows.dtype, torch.float32)
    gathered = rows[rows_of_token]
    summed = (gathered if accumulate == rows.dtype else gathered.to(accumulate)).sum(dim=1)
    return summed if summed.dtype == rows.dtype else summed.to(rows.dtype)


_ROW_FUNCTIONS = None


def row_functions() -> tuple:
    """``(GatherRows, SumRows)``, the two directions as autograd functions, each the other's
    gradient (built on first use, by the patch factories: torch is imported lazily, and dynamo
    cannot trace a class statement)."""
    global _ROW_FUNCTIONS
    if _ROW_FUNCTIONS is None:
        import torch

        class GatherRows(torch.autograd.Function):
            """``out[r] = x[token_of_row[r]]``; the gradient sums each token's rows."""

            @staticmethod
            def forward(ctx, x, token_of_row, rows_of_token):
                ctx.save_for_backward(rows_of_token)
                return x.index_select(0, token_of_row)

            @staticmethod
            def backward(ctx, grad):
                (rows_of_token,) = ctx.saved_tensors
                return _sum_rows(grad, rows_of_token), None, None

        class SumRows(torch.autograd.Function):
            """``out[t] = sum_j y[rows_of_token[t, j]]`` (fp32); the gradient gathers."""

            @staticmethod
            def forward(ctx, y, rows_of_token, token_of_row):
                ctx.save_for_backward(token_of_row)
                return _sum_rows(y, rows_of_token)

            @staticmethod
            def backward(ctx, grad):
                (token_of_row,) = ctx.saved_tensors
                return grad.index_select(0, token_of_row), None, None

        _ROW_FUNCTIONS = (GatherRows, SumRows)
    return _ROW_FUNCTIONS


def gather_permute(tokens, routing_map, probs, num_out_tokens: int, topk: int):
    """Permutation 1 as a gather: ``(permuted tokens, permuted probs, token of every row)``,
    the row map in the format of upstream's unfused permute (1-D)."""
    flat_order, token_of_row = permutation_maps(routing_map, num_out_tokens)
    gather, _ = row_functions()
    permuted = gather.apply(
        tokens, token_of_row, rows_of_tokens(token_of_row, tokens.shape[0], topk)
    )
    permuted_probs = None if probs is None else probs.T.reshape(-1).index_select(0, flat_order)
    return permuted, permuted_probs, token_of_row


def sum_unpermute(permuted_tokens, token_of_row, restore_shape):
    """The inverse of :func:`gather_permute` (no probabilities): each token's rows summed."""
    num_tokens = restore_shape[0]
    _, sum_rows = row_functions()
    topk = token_of_row.shape[0] // num_tokens
    return sum_rows.apply(
        permuted_tokens, rows_of_tokens(token_of_row, num_tokens, topk), token_of_row
    )


@patch(
    "torch_compile.moe_permute_traceable",
    f"{_TOKEN_DISPATCHER}.permute",
    reason="--moe-permute-fusion's TE permute is Triton launched from Python on every compiled "
    "layer's host path: while compiling, the dropless all-to-all permutation as a gather inductor "
    "fuses (gradient: each token's k rows summed in fp32, no atomics)",
    enabled=traceable_permutation,
    flags=(FLAG, "--moe-permute-fusion"),
)
def _permute_factory(original):
    row_functions()  # classes are built here, not while dynamo traces

    @functools.wraps(original)
    def permute(
        tokens,
        routing_map,
        probs=None,
        num_out_tokens=None,
        fused=False,
        drop_and_pad=False,
        tokens_per_expert=None,
        align_size=0,
    ):
        topk = PERMUTE_TOPK[0]
        if (
            topk
            and fused
            and not drop_and_pad
            and not align_size
            and tracing()
            and tokens.dim() == 2
            and isinstance(num_out_tokens, int)
            and num_out_tokens == routing_map.shape[0] * topk
        ):
            permuted, permuted_probs, token_of_row = gather_permute(
                tokens, routing_map, probs, num_out_tokens, topk
            )
            return permuted, permuted_probs, token_of_row, None, tokens_per_expert
        return original(
            tokens,
            routing_map,
            probs=probs,
            num_out_tokens=num_out_tokens,
            fused=fused,
            drop_and_pad=drop_and_pad,
            tokens_per_expert=tokens_per_expert,
            align_size=align_size,
        )

    return permute


@patch(
    "torch_compile.moe_unpermute_traceable",
    f"{_TOKEN_DISPATCHER}.unpermute",
    reason="the inverse of torch_compile.moe_permute_traceable: each token's k rows summed in "
    "fp32, as TE's unpermute does; TE's row maps still go to TE",
    enabled=traceable_permutation,
    flags=(FLAG, "--moe-permute-fusion"),
)
def _unpermute_factory(original):
    row_functions()

    @functools.wraps(original)
    def unpermute(
        permuted_tokens,
        sorted_indices,
        restore_shape,
        probs=None,
        routing_map=None,
        fused=False,
        drop_and_pad=False,
        pad_offsets=None,
    ):
        # A 1-D row map with fused=True comes only from gather_permute (TE's mask map is 2-D):
        # honour it eagerly too, should the permutation have been traced and this call not.
        if fused and sorted_indices.dim() == 1:
            if probs is not None or drop_and_pad or pad_offsets is not None:
                raise PatchsetError(
                    f"{PERMUTATION_PATCHES[1]}: a gathered permutation cannot be undone with "
                    "merging probabilities, drop-and-pad or padding offsets"
                )
            return sum_unpermute(permuted_tokens, sorted_indices, restore_shape)
        return original(
            permuted_tokens,
            sorted_indices,
            restore_shape,
            probs=probs,
            routing_map=routing_map,
            fused=fused,
            drop_and_pad=drop_and_pad,
            pad_offsets=pad_offsets,
        )

    return unpermute


PERMUTATION_PATCHES = (
    "torch_compile.moe_permute_traceable",
    "torch_compile.moe_unpermute_traceable",
)
