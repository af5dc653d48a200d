"""tools/bench/kernel_timings.py without a GPU: it says that it needs one and exits non-zero (no
traceback)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench", "kernel_timings.py"), "--reps", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "tools/bench/kernel_timings.py: needs a CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
