"""Delayed weight gradients overlapping the pipeline's backward P2P.

Megatron's fine-grained 1F1B schedule overlaps the EP all-to-all with the other micro-batch's
compute (``--overlap-moe-expert-parallel-comm``) and computes weight gradients separately
(``--delay-wgrad-compute``, TransformerEngine) so that the fork's three flags can defer them
behind the pipeline's backward sends and receives. The pipeline layout (pipeline-parallel size,
virtual stages) comes from the launcher. The all-to-all and compute streams run at once: several
hardware queues are needed.
"""

from megatron.patchset.recipes import recipe as r


def _build(k) -> r.Built:
    flags = ["--expert-model-parallel-size", str(k.ep)]
    flags += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if k.p2p_overlap:
        if k.bwd_on_comm:
            flags += ["--overlap-p2p-backward-on-comm-stream"]
        flags += ["--overlap-p2p-wgrad-delayed-layer-number", str(k.delayed_layers)]
        if k.tl_wgrad:
            flags += ["--overlap-p2p-with-transformer-layer-wgrad"]
    return r.Built(tuple(flags), env=(("CUDA_DEVICE_MAX_CONNECTIONS", "32"),))


RECIPE = r.Recipe(
    name="p2p_overlap",
    summary="megatron's fine-grained MoE schedule with weight gradients deferred behind the "
    "pipeline's backward P2P",
    knobs=(
        r.whole("EP", 2, "expert-parallel size"),
        r.switch("P2P_OVERLAP", True, "0: none of the fork's three flags"),
        r.switch("BWD_ON_COMM", True, "--overlap-p2p-backward-on-comm-stream"),
        r.whole("DELAYED_LAYERS", 2, "--overlap-p2p-wgrad-delayed-layer-number", minimum=0),
        r.switch("TL_WGRAD", True, "--overlap-p2p-with-transformer-layer-wgrad"),
    ),
    build=_build,
)
