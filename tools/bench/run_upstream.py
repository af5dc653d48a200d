"""Run an upstream Megatron-LM entry script unmodified against the megatron-core wheel.

    PYTHONPATH=/path/to/Megatron-LM torchrun ... tools/bench/run_upstream.py \\
        /path/to/Megatron-LM/pretrain_gpt.py <megatron flags>

This is the "unpatched upstream" baseline of the GPU tests and ``tools/bench/bench.py``: only the
registry's ``compat`` patches (what any script needs to run from the wheel at all, e.g. the
dataset helpers build) and ``observe`` patches (``MEGATRON_PATCHSET_METRICS`` recording) are
applied; no fork feature is. The script's folder must come first on ``PYTHONPATH`` so that its
sibling modules (``gpt_builders.py``, ``model_provider.py``) import as they do in a Megatron-LM
checkout; ``tools/bench/bench.py --upstream-script`` and the GPU tests set it. Megatron-LM's code
is not part of this repository: point this at a checkout whose release matches megatron-core
0.19.2 (branch ``core_r0.19.0``).
"""

import os
import runpy
import sys

from megatron.patchset.core import registry
from megatron.patchset.core.observe import metrics

NAME = "tools/bench/run_upstream.py"


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        sys.exit(
            f"usage: PYTHONPATH=/path/to/Megatron-LM {NAME} /path/to/Megatron-LM/<script>.py "
            "[megatron flags]"
        )
    script = os.path.abspath(sys.argv[1])
    if not os.path.exists(script):
        sys.exit(f"{NAME}: {script} does not exist")
    folder = os.path.dirname(script)
    if folder not in {os.path.abspath(p) for p in sys.path if p}:
        sys.exit(f"{NAME}: {folder} is not on PYTHONPATH (its sibling modules import from there)")
    sys.argv = [script] + sys.argv[2:]

    applied = registry.apply_patches(
        [p for p in registry.registered() if p.kind != "feature" and p.wanted(None)]
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"> run_upstream: {script} with patches: {', '.join(applied) or 'none'}", flush=True)
    runpy.run_path(script, run_name="__main__")
    metrics.write_summary()


if __name__ == "__main__":
    main()
