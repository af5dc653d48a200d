"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` with this project's metrics recording
(``observe.metrics_jsonl``, for ``MEGATRON_PATCHSET_METRICS``) and nothing else of it.

    PYTHONPATH=/path/to/checkout torchrun ... tests/gpu/harness/run_checkout.py \\
        /path/to/checkout/pretrain_gpt.py <megatron flags>

The checkout is not the pinned wheel (an edited core_r0.19.0 is megatron-core 0.19.1), so the
version guard is not asked: the one patch applied here only records ``training_log``'s values.
"""

import os
import runpy
import sys

from megatron.patchset.core import registry
from megatron.patchset.core.observe import metrics


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script] + sys.argv[2:]
    registry.apply_patches([registry.get("observe.metrics_jsonl")], check=False)
    runpy.run_path(script, run_name="__main__")
    metrics.write_summary()


if __name__ == "__main__":
    main()
