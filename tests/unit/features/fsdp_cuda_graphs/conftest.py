"""Fixtures of this folder's tests."""

import pytest


@pytest.fixture(autouse=True)
def _fsdp_allows_connections(monkeypatch):
    # megatron's validate_args refuses Megatron-FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1.
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
