"""Test-only stand-ins for the few ``torch.cuda`` calls on megatron's forward/backward path,
so that a tiny local-spec MoE GPTModel trains on the CPU (gloo process groups).

Used only by tests; installed and removed through pytest's ``monkeypatch``.
"""

import contextlib

import torch


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def synchronize(self):
        pass


_STREAM = _Stream()


def install(monkeypatch):
    """Install the shims (no-op on a machine with a GPU)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as tp_random

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _STREAM)
    monkeypatch.setattr(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    # The all-to-all dispatcher turns split sizes into host arrays only for CUDA tensors; do the
    # same for CPU tensors so that gloo's all_to_all gets lists.
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", to_host)
    # The model-parallel RNG tracker swaps CUDA RNG states around dropout; keep the CPU RNG.
    monkeypatch.setattr(
        tp_random.CudaRNGStatesTracker, "fork", lambda self, *a, **k: contextlib.nullcontext()
    )


# Flags that make the tiny MoE config run on the CPU: the local (non-TE) layer spec, no fused
# kernels that need TransformerEngine/apex, no grouped GEMM (it needs the grouped_gemm package).
CPU_FLAGS = [
    "--transformer-impl",
    "local",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-bias-dropout-fusion",
    "--no-bias-swiglu-fusion",
    "--no-masked-softmax-fusion",
    "--attention-backend",
    "unfused",
]
