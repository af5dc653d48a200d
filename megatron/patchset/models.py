"""Hooks into megatron's model builder (``megatron.training.models``).

``GPTModelConfig.pre_wrap_hooks`` run on the list of model chunks after they are built and
before DDP/Megatron-FSDP wrap them; ``post_wrap_hooks`` run after wrapping. The fork's
features that transform built modules (rather than patch upstream code) plug in here.
"""

from __future__ import annotations

import argparse
from typing import Callable

ModelHook = Callable[[list], list]


def configure_transformer_config(args: argparse.Namespace, config) -> None:
    """Copy the fork's model-level options from the flags onto megatron's TransformerConfig.

    Fork options that upstream code paths read from the config (for instance the schedule
    plan) live there as extra attributes; code reading them uses ``getattr`` with the upstream
    behaviour as default, so a config without them behaves exactly as upstream.
    """
    from megatron.patchset import schedule_plan

    # The fine-grained schedule plan's P2P-overlap options (--overlap-p2p-*).
    if all(hasattr(args, name) for name in schedule_plan.DEFAULTS):
        schedule_plan.set_p2p_overlap_options(
            config, **{name: getattr(args, name) for name in schedule_plan.DEFAULTS}
        )


def pre_wrap_hooks(args: argparse.Namespace) -> list[ModelHook]:
    """Hooks the parsed flags ask for, in the order they must run."""
    hooks: list[ModelHook] = []
    from megatron.patchset import compile as ps_compile

    if ps_compile.requested(args):  # compile last: after any hook that changes the layers
        hooks.append(ps_compile.pre_wrap_hook(args))
    return hooks
