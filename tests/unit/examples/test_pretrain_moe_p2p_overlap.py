"""The backward-P2P-overlap launch scripts pass pretrain_gpt.py --dry-run at their stated world
size (their DRY_RUN=1 mode runs exactly the flags they would launch with)."""

import os

import pytest

from tests.unit.conftest import dry_run_example

SCRIPTS = {
    "local": os.path.join("examples", "pretrain_moe_p2p_overlap.sh"),
    "slurm": os.path.join("examples", "slurm", "pretrain_moe_p2p_overlap.sbatch"),
}


def dry_run(script, **knobs):
    proc = dry_run_example(SCRIPTS[script], **knobs)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_layout_is_valid_with_the_p2p_flags(script):
    code, out, err = dry_run(script)
    assert code == 0, out + err
    for line in (
        "world size ........................ 4",
        "pipeline model parallel (PP) ...... 2",
        "virtual pipeline stages (VPP) ..... 2",
        "expert model parallel (EP) ........ 2",
        "fork features enabled: p2p_overlap (--overlap-p2p-backward-on-comm-stream, "
        "--overlap-p2p-wgrad-delayed-layer-number 2, --overlap-p2p-with-transformer-layer-wgrad)",
        "p2p_overlap.schedule_plan",
    ):
        assert line in out, line
    assert out.rstrip().endswith("dry-run: OK")
    assert "Traceback" not in err


def test_script_knobs_reach_the_rules():
    """A delayed-layer number larger than a chunk (2 layers here) is refused before launch."""
    code, out, _ = dry_run("local", DELAYED_LAYERS="3")
    assert code != 0
    assert "[p2p-overlap-delayed-layer-number-range]" in out and "Use 1 to 2" in out
