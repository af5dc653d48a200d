"""Why ``p2p_overlap`` is not a change of the patch series (``export --series``).

Its schedule plan (:mod:`.schedule_plan`) runs each forward node of a layer inside
``layer.get_low_precision_context()``, the name megatron-core 0.19.2 gives the
``TransformerLayerSchedulePlan`` method in ``megatron/core/models/common/
model_chunk_schedule_plan.py``. Megatron-LM core_r0.19.0 (0.19.1) and main name that method
``get_fp8_context`` (a different body: it builds the FP8 context itself), and their
``TransformerLayerSchedulePlan.run`` calls it five times, where 0.19.2 calls
``get_low_precision_context``. An in-place change of upstream's two ``run`` methods would have to
be anchored around those five lines and would no longer be the code the overlay runs (a subclass
of 0.19.2's plans, whose bit-identity to upstream was measured on GPUs), so the feature is
refused by name instead. The file-level export refuses it on both trees for the same name
(:mod:`megatron.patchset.export.uses`).
"""

from megatron.patchset.export.changes import Refusal

SCHEDULE_PLAN = "megatron/core/models/common/model_chunk_schedule_plan.py"

REFUSAL = Refusal(
    name="p2p_overlap",
    reason=(
        "its schedule plan calls TransformerLayerSchedulePlan.get_low_precision_context(), which "
        f"megatron-core 0.19.2's {SCHEDULE_PLAN} defines; Megatron-LM core_r0.19.0 (0.19.1) and "
        "main name that method get_fp8_context() and call it in TransformerLayerSchedulePlan.run, "
        "so the change cannot be one edit that the overlay and the export share (its upstream "
        "proposal, NVIDIA/Megatron-LM#4268, was closed unmerged)"
    ),
    short="get_low_precision_context() of megatron-core 0.19.2 is get_fp8_context() in "
    "Megatron-LM core_r0.19.0 and main",
)
