"""What ``pretrain_gpt.py`` asks of the features while it builds the model config.

Features whose flag leaves megatron arguments to be chosen from the validated layout set them
(:func:`resolve_arguments`) before the config is built. Features whose options their patches
read from megatron's ``TransformerConfig`` copy them onto it (:func:`configure_transformer_config`).
What a feature does to the built model chunks is a registered patch of megatron's model builder
(``torch_compile.compile_layers``), so that ``--list`` shows it and
``MEGATRON_PATCHSET_SKIP_PATCHES`` can leave it out: no feature adds to
``GPTModelConfig.pre_wrap_hooks``.
"""

from __future__ import annotations

import argparse

from megatron.patchset.core import features
from megatron.patchset.core.provided import provided


def configure_transformer_config(args: argparse.Namespace, config) -> None:
    """Copy every feature's model-level options from the flags onto megatron's TransformerConfig.

    megatron-core neither defines nor reads these attributes; the features' patches read them
    with ``getattr`` and upstream's behaviour as default, so a config without them, or a run
    without those patches, behaves exactly as upstream.
    """
    for feature in features.load():
        if feature.configure_config is not None and not provided(feature.name):
            feature.configure_config(args, config)


def resolve_arguments(args: argparse.Namespace) -> list[str]:
    """Let every enabled feature with a ``resolve_args`` set the arguments its flag chooses, after
    megatron's validation and before the model's config is built; the lines they log."""
    lines = []
    for feature in features.enabled(args):
        if feature.resolve_args is not None and not provided(feature.name):
            line = feature.resolve_args(args)
            if line:
                lines.append(line)
    return lines
