"""megatron-patchset: fast Mixture-of-Experts training patches over megatron-core 0.19.2."""

import os
import re

from setuptools import find_namespace_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "megatron", "patchset", "__init__.py")) as handle:
    VERSION = re.search(r'^__version__ = "([^"]+)"', handle.read(), re.M).group(1)
with open(os.path.join(HERE, "README.md")) as handle:
    LONG_DESCRIPTION = handle.read()

setup(
    name="megatron-patchset",
    version=VERSION,
    description="Patch-set overlay on megatron-core 0.19.2 for fast Mixture-of-Experts training",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    # Only our namespace portion: megatron.core and megatron.training come from the wheel,
    # and there is deliberately no megatron/__init__.py.
    packages=find_namespace_packages(include=["megatron.patchset", "megatron.patchset.*"]),
    install_requires=[
        "megatron-core==0.19.2",
        "torch>=2.6",
        "numpy",
        "packaging>=24.2",
        "nvidia-ml-py",
        "psutil",  # megatron-core's checkpoint writer (--save)
    ],
    extras_require={
        # TransformerEngine: the TE layer spec, grouped GEMM, CUDA graphs, NCCL EP. Needs CUDA.
        "te": ["transformer-engine[pytorch]==2.20.2"],
        "test": ["pytest>=8", "hypothesis>=6"],
        "bench": ["matplotlib"],
        # Peers for tools/bench/bench.py (tools/bench/peers/): torchtitan's Qwen3-MoE through its
        # own model, compile and CUDA-graph code. Offline GPU machines:
        # tools/bench/peers/prepare_wheels.sh.
        "bench-peers": ["torchtitan==0.3.0"],
        # DeepEP and NVIDIA apex are optional and not installable from the registry in a usable
        # form: see docs/deepep.md and tools/build/build_deepep.sh; apex is never required.
    },
    entry_points={"console_scripts": ["megatron-patchset=megatron.patchset.__main__:main"]},
)
