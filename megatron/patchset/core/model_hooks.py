"""Hooks into megatron's model builder (``megatron.training.models``), collected from the features.

``GPTModelConfig.pre_wrap_hooks`` run on the list of model chunks after they are built and before
DDP/Megatron-FSDP wrap them. The features that transform built modules (rather than patch
upstream code) plug in here, and those whose options upstream code reads from the
``TransformerConfig`` copy them onto it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron.patchset.core import features
from megatron.patchset.core.provided import provided

ModelHook = Callable[[list], list]


def configure_transformer_config(args: argparse.Namespace, config) -> None:
    """Copy every feature's model-level options from the flags onto megatron's TransformerConfig.

    Code reading them uses ``getattr`` with the upstream behaviour as default, so a config
    without them behaves exactly as upstream.
    """
    for feature in features.load():
        if feature.configure_config is not None and not provided(feature.name):
            feature.configure_config(args, config)


def pre_wrap_hooks(args: argparse.Namespace) -> list[ModelHook]:
    """Hooks the parsed flags ask for, in feature order (only ``torch_compile`` has one: a hook
    that changes layers must come before it, since compilation traces what it finds)."""
    return [
        feature.pre_wrap_hook(args)
        for feature in features.enabled(args)
        if feature.pre_wrap_hook is not None and not provided(feature.name)
    ]
