"""The P2P-overlap options: upstream defaults, validation, and their copy onto the
TransformerConfig."""

import types

import pytest

from megatron.patchset.core import model_hooks
from megatron.patchset.features.p2p_overlap import flags as p2p_flags


def options(comm=False, n=1, tl=False):
    return types.SimpleNamespace(
        overlap_p2p_backward_on_comm_stream=comm,
        overlap_p2p_wgrad_delayed_layer_number=n,
        overlap_p2p_with_transformer_layer_wgrad=tl,
    )


def test_options_default_to_upstream():
    assert p2p_flags.options_from_config(types.SimpleNamespace()) == p2p_flags.P2POverlapOptions(
        False, 1, False
    )
    assert p2p_flags.options_from_config(None) == p2p_flags.P2POverlapOptions(False, 1, False)


def test_set_options_stores_and_validates():
    config = types.SimpleNamespace()
    p2p_flags.set_p2p_overlap_options(
        config,
        overlap_p2p_backward_on_comm_stream=True,
        overlap_p2p_wgrad_delayed_layer_number=3,
        overlap_p2p_with_transformer_layer_wgrad=True,
    )
    assert p2p_flags.options_from_config(config) == p2p_flags.P2POverlapOptions(True, 3, True)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="overlap_p2p_wgrad_delayed_layer_number"):
            p2p_flags.set_p2p_overlap_options(config, overlap_p2p_wgrad_delayed_layer_number=bad)


def test_requested_only_for_non_default_values():
    assert not p2p_flags.requested(types.SimpleNamespace())
    assert not p2p_flags.requested(None)
    assert not p2p_flags.requested(options())
    assert p2p_flags.requested(options(comm=True))
    assert p2p_flags.requested(options(n=2))
    assert p2p_flags.requested(options(tl=True))


def test_configure_transformer_config_copies_the_flags(tiny):
    from tests.unit.conftest import parse

    args = parse(
        tiny(
            "--overlap-p2p-backward-on-comm-stream",
            "--overlap-p2p-wgrad-delayed-layer-number",
            "2",
            "--overlap-p2p-with-transformer-layer-wgrad",
        )
    )
    config = types.SimpleNamespace()
    model_hooks.configure_transformer_config(args, config)
    assert p2p_flags.options_from_config(config) == p2p_flags.P2POverlapOptions(True, 2, True)
    untouched = types.SimpleNamespace()
    model_hooks.configure_transformer_config(
        types.SimpleNamespace(), untouched
    )  # args without the flags
    assert vars(untouched) == {}
