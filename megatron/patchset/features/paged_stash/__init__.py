"""MoE paged stashing on Hopper in bf16 (docs/features/paged_stash.md).

megatron-core's paged stashing (``--moe-paged-stash`` with ``--moe-expert-rank-capacity-factor``,
the ``hybridep`` or ``ncclep`` flex dispatcher and TE's op fuser,
``--use-transformer-engine-op-fuser``) keeps
the expert MLP's saved activations in a pool of fixed-size pages instead of one static
``[budget, hidden]`` tensor per layer, so that a static per-rank receive budget (what makes the
dispatch sync-free and graph-friendly) does not cost budget-sized activation memory. Upstream
only runs it on Blackwell with MXFP8. On Hopper in bf16 three things stand in the way; the
patches here fix them:

1. **Nothing is paged.** megatron's ``saved_tensors_hooks`` page only tensors that carry the
   attribute ``grouped_tensor_scale_inv``; TE sets it only in its Blackwell fused grouped MLP and
   in the ``GroupedLinear`` *module*, never in the op-fuser *basic* ops that run on Hopper
   (``ops.GroupedLinear``, ``ops.ScaledSwiGLU``). The capture step then records nothing and
   every step saves full-size activations. Patch ``paged_stash.te_expert_ops`` gives the
   experts' op-fuser ops subclasses that mark the three expert activations (FC1 input, SwiGLU input,
   FC2 input), each ``[rows of the static buffer, width]`` as megatron's hook expects.
2. **Slack rows break the bf16 grouped GEMM.** HybridEP with a receive budget returns a static
   ``[budget, hidden]`` buffer of which only ``sum(tokens_per_expert)`` rows are real. TE 2.20.2
   consumes such a buffer only on its "grouped-tensor" GEMM path, which on Hopper needs
   cuBLASLt >= 13.4 (torch 2.11's cu130 wheels ship 13.1); otherwise it takes the split path,
   ``torch.split(x, split_sizes.tolist())``, which raises when the sizes do not cover every
   row. The same patch runs the split path on the real rows only and gives
   the slack rows a zero output (forward) and a zero input gradient (backward). The split path
   saves per-expert views of its input, which megatron's hook cannot page (it assumes one
   ``[rows, width]`` tensor), so under paged stashing the whole input is saved instead and split
   again in backward.
3. **Partial CUDA graphs drop the static budget.** With ``--cuda-graph-modules ...
   moe_preprocess`` the dispatcher's preprocessing (``_HybridEPManager.setup_metadata``, which
   sets the budget as a Python int) runs only while the graph is captured; on replay only tensor
   attributes are restored, so from the second replay HybridEP silently falls back to dynamic,
   CPU-synchronised dispatch with no budget. ``paged_stash.hybridep_budget_on_graph_replay``
   recomputes the budget from the restored routing map's shape before each dispatch.

Two observe patches make the run legible: ``paged_stash.report_buffers`` prints what the stash
allocated (or that nothing was marked, i.e. nothing is paged) and ``paged_stash.report_overflow``
prints one clear line when a step overflowed the stash buffer or the HybridEP receive budget and
megatron re-runs it (dropless, stash off), and when the re-run finished.

The grouped-tensor GEMM path (cuBLASLt >= 13.4) keeps TE's own slack-row handling; on it the
patch only marks the saved input (not exercised on this stack).

**The ncclep backend** (TE 2.20's NCCL EP; facts from megatron-core 0.19.2's
``transformer/moe/token_dispatcher.py``, ``experts.py`` and ``paged_stash.py``):

- Expert input. ``_NCCLEPManager`` sizes its receive buffer once, at the first dispatch
  (``_ensure_bootstrap``, token_dispatcher.py:1593-1609): local tokens rounded up to 64, x top-k
  x ``--moe-expert-rank-capacity-factor``, rounded up to the alignment, which is 256 with the op
  fuser (moe_utils.py:1407). Each local expert's rows are padded to that alignment and
  ``tokens_per_expert`` counts the padding. Without ``--moe-ncclep-static-shape`` the experts get
  the buffer narrowed to ``sum(tokens_per_expert)`` rows (a host sync,
  token_dispatcher.py:1694-1701),
  so megatron's stash sizes its pages from that data-dependent count divided by the factor
  (experts.py:654-670, paged_stash.py:569) and overflows, and re-runs, nearly every step; the
  fork's rule ``paged-stash-ncclep-static-shape`` asks for the flag. With it the experts get the
  whole static ``[budget, hidden]`` buffer with slack rows and ``[budget]`` fp32 probabilities,
  as with HybridEP, and ``paged_stash.te_expert_ops`` applies unchanged (megatron allows the
  static shape in bf16 on sm_90 with the op fuser and grouped GEMM, token_dispatcher.py:1534-1545).
- Partial CUDA graphs. ``setup_metadata`` (token_dispatcher.py:1586-1591) sets
  ``token_probs``/``token_indices`` (restored on replay, ``cudagraph_attrs`` line 1796) and
  ``num_local_tokens``, a Python int that nothing resets; the budget is a bootstrap-time
  attribute. Nothing is lost on replay, so no counterpart of
  ``hybridep_budget_on_graph_replay`` is needed.
- Budget overflow. NCCL EP cannot drop tokens: exceeding the budget traps the kernel (the run
  dies; transformer_config.py:977-982). The manager has no ``over_budget`` flag, so
  ``check_over_budget`` returns None (token_dispatcher.py:1988-1993), and its factor attribute is
  ``rank_capacity_factor``, so ``prepare_for_rerun``'s ``hasattr(..,
  'moe_expert_rank_capacity_factor')`` (paged_stash.py:1097-1101) is False: the re-run after a
  stash overflow keeps the static budget and only turns paging off. ``report_overflow`` says so.
  Be generous with the factor (the example uses 2.0).
- ``--moe-ncclep-zero-copy`` (symmetric-memory FC2 output and FC1 dgrad buffers, passed to the
  op fuser as ``out_buffer``/``dgrad_out``, which the patched split path honours) is not
  exercised here.
"""

from megatron.patchset.core.features import Feature
from megatron.patchset.features.paged_stash.flags import FLAGS, requested, static_budget


def _in_use(args) -> list[str]:
    factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    return ([FLAGS[0]] if requested(args) else []) + (
        [f"--moe-expert-rank-capacity-factor {factor}"] if factor is not None else []
    )


FEATURE = Feature(
    name="paged_stash",
    title="MoE paged stashing on Hopper in bf16",
    switches=FLAGS[:1] + ("--moe-expert-rank-capacity-factor",),
    enabled=lambda args: requested(args) or static_budget(args),
    upstream_pr="fork-only (megatron-core 0.19.2 pages activations only on Blackwell in MXFP8)",
    status="experimental",
    modules=tuple(f"{__name__}.{m}" for m in ("rules", "expert_ops", "budget", "report", "rerun")),
    in_use=_in_use,
)
