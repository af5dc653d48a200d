"""Layout rules: megatron's own flags, checked before megatron's ``validate_args``.

Sizes first (a gate: the other rules divide by them), then the parallel layout against the world
size, the model's shape and precision, the data and tokenizer, and megatron-core 0.19.2's late
failures of the schedule; last the core's own flags. megatron checks these late (at process-group
creation, after the model is built), with messages that do not name the flag, or not at all. The
import order is the order of the rules in the table.
"""

# ruff: noqa: I001, F401
from megatron.patchset.core.layout_rules import sizes
from megatron.patchset.core.layout_rules import parallel
from megatron.patchset.core.layout_rules import model
from megatron.patchset.core.layout_rules import data
from megatron.patchset.core.layout_rules import schedule
from megatron.patchset.core.layout_rules import fork_flags
