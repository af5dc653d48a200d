"""Fixtures of the compile tests: a fresh dynamo with its counters, the compiled-layer state that
compile_layer's wrapper sets, and the graph-break count."""

import pytest

from megatron.patchset.features.torch_compile import tracing


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.fixture
def in_compiled_layer():
    """What compile_layer's wrapper sets around a compiled TransformerLayer's call."""
    tracing.IN_COMPILED_LAYER[0] = True
    yield
    tracing.IN_COMPILED_LAYER[0] = False


def breaks(counters) -> int:
    return sum(counters["graph_break"].values())
