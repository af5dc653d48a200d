"""TransformerEngine 2.20.2's NCCL EP custom ops made callable on torch 2.11.

``transformer_engine_ep::prepare_and_dispatch`` declares mutated arguments with defaults
(``recv_scale_inv=None``, only used for FP8); torch's boxed call drops trailing arguments that
equal their defaults, and the ``ADInplaceOrView`` kernel ``torch.library.custom_op`` registered
indexes them anyway (``IndexError: tuple index out of range`` at the first bf16 dispatch).
:func:`repair_mutable_default_kernels` re-registers that kernel.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

TE_EP_OP_NAMESPACE = "transformer_engine_ep"
# namespace -> torch.library.Library (the registrations live as long as the library object)
_REPAIR_LIBRARIES: dict = {}
_REPAIRED: set = set()


def mutated_arguments(schema) -> list[tuple[int, str]]:
    """(position, name) of the arguments an op mutates."""
    return [
        (i, arg.name)
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


def repair_mutable_default_kernels(namespace: str) -> list[str]:
    """Re-register the ``ADInplaceOrView`` kernel of every op of ``namespace`` that mutates an
    argument with a default value, bumping the version only of the mutated arguments that were
    actually passed, then redispatching as torch's own kernel does. Idempotent; returns the ops
    repaired by this call.

    ``torch.library.custom_op`` (torch 2.11) registers that kernel as ``for idx in mutated:
    increment_version(args[idx])``; the dispatcher hands Python kernels the arguments without the
    trailing ones that equal their defaults, so a call that leaves ``recv_scale_inv=None`` raises
    ``IndexError`` before the op runs."""
    import torch

    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith(namespace + "::")]
    repaired = []
    for full in sorted(names):
        name = full.split("::", 1)[1]
        if full in _REPAIRED or "." in name:
            continue
        packet = getattr(getattr(torch.ops, namespace), name)
        op = packet.default
        mutated = tuple(mutated_arguments(op._schema))
        # Only a mutated argument with a default can be left out of the boxed call.
        if not any(op._schema.arguments[i].has_default_value() for i, _ in mutated):
            continue

        def kernel(keyset, *args, _op=op, _mutated=mutated, **kwargs):
            for index, arg_name in _mutated:
                value = args[index] if index < len(args) else kwargs.get(arg_name)
                if isinstance(value, torch.Tensor):
                    torch.autograd.graph.increment_version(value)
            return _op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

        library = _REPAIR_LIBRARIES.get(namespace)
        if library is None:
            library = _REPAIR_LIBRARIES[namespace] = torch.library.Library(namespace, "IMPL")
        library.impl(name, kernel, "ADInplaceOrView", with_keyset=True, allow_override=True)
        _REPAIRED.add(full)
        repaired.append(full)
    if repaired:
        logger.info(
            "megatron-patchset: ADInplaceOrView kernels of %s tolerate dropped default arguments",
            ", ".join(repaired),
        )
    return repaired
