"""The core's own flags that act only with another (the features' rules refuse theirs)."""

from __future__ import annotations

from megatron.patchset.core.rules import listed, rule


@rule(
    "fork-flags-need-their-switch",
    phase="layout",
    flags=("--dry-run-world-size", "--dry-run", "--load-allow-missing", "--load"),
)
def _need_their_switch(args):
    """--dry-run-world-size acts only in a dry run, --load-allow-missing only with --load."""
    problems = []
    size = getattr(args, "dry_run_world_size", None)
    if size is not None and not getattr(args, "dry_run", False):
        problems.append(
            f"--dry-run-world-size {size} only acts with --dry-run (a launch runs on the world "
            "size torchrun gives it): add --dry-run or drop the flag"
        )
    if getattr(args, "load_allow_missing", False) and not getattr(args, "load", None):
        problems.append("--load-allow-missing only acts with --load: add --load or drop the flag")
    return listed("", problems)
