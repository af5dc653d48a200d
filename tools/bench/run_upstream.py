"""Run an upstream Megatron-LM entry script unmodified against the megatron-core wheel.

    PYTHONPATH=/path/to/Megatron-LM torchrun ... tools/bench/run_upstream.py \\
        /path/to/Megatron-LM/pretrain_gpt.py <megatron flags>

This is the "unpatched upstream" baseline of the GPU tests and ``tools/bench/bench.py``: only the
registry's ``compat`` patches (what any script needs to run from the wheel at all, e.g. the
dataset helpers build) and ``observe`` patches (``MEGATRON_PATCHSET_METRICS`` recording) are
applied; no fork feature is. The script's folder must be on ``PYTHONPATH`` so that its sibling
modules (``gpt_builders.py``, ``model_provider.py``) import as they do in a Megatron-LM checkout;
``tools/bench/bench.py --upstream-script`` and the GPU tests set it. The folder is then moved
behind the installed packages: a checkout's own ``megatron/`` (megatron-core 0.19.1 on
``core_r0.19.0``) is a namespace portion like the wheel's, and first on the path it would replace
the pinned ``megatron.core`` and ``megatron.training``. Behind them it still provides what the
wheel does not install, e.g. ``megatron.legacy``, which the checkout's ``gpt_builders.py``
imports: that part of the baseline is the checkout's code. Megatron-LM's code is not part of this
repository: point this at a checkout whose release matches megatron-core 0.19.2 (branch
``core_r0.19.0``).
"""

import importlib
import os
import runpy
import sys

NAME = "tools/bench/run_upstream.py"


def folder_last(folder: str) -> None:
    """Move ``folder`` (every entry that names it, through links too) to the end of ``sys.path``:
    its modules still import, and every package installed in the environment (the pinned
    megatron-core among them) comes before it."""
    sys.path[:] = [p for p in sys.path if not names(p, folder)] + [folder]


def names(entry: str, folder: str) -> bool:
    """Whether the ``sys.path`` entry ``entry`` is ``folder``, through links too."""
    return bool(entry) and os.path.realpath(entry) == os.path.realpath(folder)


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
    if not any(names(p, folder) for p in sys.path):
        sys.exit(f"{NAME}: {folder} is not on PYTHONPATH (its sibling modules import from there)")
    folder_last(folder)
    sys.argv = [script] + sys.argv[2:]
    registry = importlib.import_module("megatron.patchset.core.registry")
    metrics = importlib.import_module("megatron.patchset.core.observe.metrics")

    applied = registry.apply_patches(
        [p for p in registry.registered() if p.kind != "feature" and p.wanted(None)]
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"> run_upstream: {script} with patches: {', '.join(applied) or 'none'}", flush=True)
    runpy.run_path(script, run_name="__main__")
    metrics.write_summary()


if __name__ == "__main__":
    main()
