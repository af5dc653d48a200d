"""One rank of a larger layout on one GPU: stand-ins for the expert-parallel exchanges under
megatron's ``--fake-process-group``.

With ``--fake-process-group`` and ``WORLD_SIZE=N RANK=r`` one process builds rank r of an N-GPU job
and every collective returns at once without moving data. That measures a rank's compute and
memory, except where the data a collective would deliver decides the work: the MoE dispatch. The
token counts megatron's all-to-all dispatcher gathers from the other expert-parallel ranks (and
the counts the fork's static dispatch exchanges) would be whatever the receive buffers held, and
the received tokens garbage that a few steps later turns the router's weights to NaN.

Two patches here stand in for the expert-parallel exchanges: every other rank of the
expert-parallel group is taken to route exactly as this rank does. An all-gather on that group
returns this rank's input once per rank; an all-to-all returns, from every peer, the chunk this
rank sends to itself. The counts are then consistent, and this rank's experts receive exactly the
rows, counts and probabilities (and, in the backward pass, the gradients) they would receive from
ranks that route alike: about ``tokens x top-k / experts`` per expert and source rank. What comes
back from the other ranks' experts in the combine has its real shape, filled with this rank's own
expert outputs (a CPU test compares both against a real exchange). Every other collective stays
the fake group's no-op: gradient reductions keep this rank's gradients, and parameter all-gathers
leave the other shards as they were. torch's fake backend itself copies an all-gather's input
into every rank's part of its output; a third patch gives the distributed optimizer's parameter
all-gather nothing to copy, since those copies (the rank's whole parameter buffer at every step)
are neither compute nor communication of the real rank. The patches act only on a group whose
backend is ``fake``; the first use prints one line saying that the exchanged tokens are
stand-ins.
"""

from __future__ import annotations

import sys

from megatron.patchset.core.registry import patch

_REASON = (
    "under --fake-process-group the expert-parallel exchanges deliver nothing: the token counts "
    "are garbage (the dispatcher sizes its buffers from them) and so are the tokens; the "
    "emulated rank needs the exchange of ranks that route as it does"
)
_said = False


def emulating(args) -> bool:
    return args is not None and bool(getattr(args, "fake_process_group", False))


def _fake_group(group) -> bool:
    """Whether ``group`` (None: the default group) is a group of the fake backend."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        return dist.get_backend(group) == "fake"
    except (RuntimeError, ValueError):
        return False


def _expert_group(group) -> bool:
    """Whether ``group`` is a fake process group over the expert-parallel ranks (EP, or TP x EP)."""
    import torch.distributed as dist

    if group is None or not _fake_group(group):
        return False
    try:
        from megatron.core import parallel_state

        ranks = dist.get_process_group_ranks(group)
        for get in (
            parallel_state.get_expert_model_parallel_group,
            parallel_state.get_expert_tensor_and_model_parallel_group,
        ):
            known = get(check_initialized=False)
            if known is not None and (
                known is group or dist.get_process_group_ranks(known) == ranks
            ):
                return True
    except (RuntimeError, ValueError, AssertionError):
        return False
    return False


def _say_once(group) -> None:
    global _said
    if not _said:
        _said = True
        print(
            f"megatron-patchset: --fake-process-group: the expert-parallel exchanges over "
            f"{group.size()} ranks are stand-ins: every rank is taken to route as this one "
            "(layout emulation; the tokens and counts of other ranks are not real)",
            file=sys.stderr,
            flush=True,
        )


def _splits(sizes, total: int, parts: int) -> list[int]:
    if sizes is None or len(sizes) == 0:
        return [total // parts] * parts
    return [int(s) for s in sizes]


def replicate_all_to_all(output, input, output_split_sizes, input_split_sizes, rank, size):
    """Fill ``output`` as an all-to-all among ranks that all send what this one sends: each
    peer's chunk is the chunk this rank sends to itself (zero-padded or cut to the chunk's
    size)."""
    sent = _splits(input_split_sizes, input.shape[0], size)
    received = _splits(output_split_sizes, output.shape[0], size)
    mine = input.narrow(0, sum(sent[:rank]), sent[rank])
    at = 0
    for length in received:
        take = min(length, mine.shape[0])
        if take:
            output.narrow(0, at, take).copy_(mine.narrow(0, 0, take))
        if length > take:
            output.narrow(0, at + take, length - take).zero_()
        at += length


@patch(
    "compat.fake_group_ep_all_to_all",
    "torch.distributed.all_to_all_single",
    kind="compat",
    reason=_REASON,
    upstream_pr="fork-only (layout emulation on one GPU)",
    flags=("--fake-process-group",),
    enabled=emulating,
)
def fake_group_all_to_all(original):
    def all_to_all_single(
        output,
        input,
        output_split_sizes=None,
        input_split_sizes=None,
        group=None,
        async_op=False,
    ):
        work = original(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        )
        if _expert_group(group):
            _say_once(group)
            replicate_all_to_all(
                output, input, output_split_sizes, input_split_sizes, group.rank(), group.size()
            )
        return work

    return all_to_all_single


@patch(
    "compat.fake_group_ep_all_gather",
    "megatron.core.tensor_parallel.mappings.dist_all_gather_func",
    kind="compat",
    reason=_REASON,
    upstream_pr="fork-only (layout emulation on one GPU)",
    flags=("--fake-process-group",),
    enabled=emulating,
)
def fake_group_all_gather(original):
    def all_gather_into_tensor(output, input, group=None, async_op=False):
        work = original(output, input, group=group, async_op=async_op)
        if _expert_group(group):
            _say_once(group)
            size = group.size()
            output.view(size, *input.shape).copy_(input.unsqueeze(0).expand(size, *input.shape))
        return work

    return all_gather_into_tensor


@patch(
    "compat.fake_group_param_all_gather",
    "megatron.core.distributed.param_and_grad_buffer.dist_all_gather_func",
    kind="compat",
    reason="under --fake-process-group torch's fake backend copies an all-gather's input into "
    "every rank's part of the output: the distributed optimizer's parameter all-gather becomes a "
    "copy of the rank's whole parameter buffer in each emulated step, which the step-time model "
    "then counts again as communication; give it nothing to copy, as other collectives move "
    "nothing",
    upstream_pr="fork-only (layout emulation on one GPU)",
    flags=("--fake-process-group",),
    enabled=emulating,
)
def fake_group_param_all_gather(original):
    # megatron-core 0.19.2 calls this name only for the distributed optimizer's parameter
    # all-gather; its group may hold the expert-parallel ranks too (EP = data-parallel size)
    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if _fake_group(group):
            # still one (empty) collective: megatron's coalescing manager and handles see a work
            return original(output.new_empty(0), input.new_empty(0), group=group, async_op=async_op)
        return original(output, input, group=group, async_op=async_op)

    return all_gather_into_tensor
