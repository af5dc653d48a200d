"""examples/pretrain_moe_compile.sh passes --dry-run with and without compilation and under
Megatron-FSDP."""

import os

import pytest


@pytest.mark.parametrize("knobs", [{}, {"FSDP": "1"}, {"COMPILE": "0"}])
def test_example_script_dry_run(knobs):
    from tests.unit.conftest import dry_run_example

    proc = dry_run_example(os.path.join("examples", "pretrain_moe_compile.sh"), NGPUS="2", **knobs)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "dry-run: OK" in proc.stdout
    features = next(
        line for line in proc.stdout.splitlines() if line.startswith("fork features enabled")
    )
    assert ("torch_compile (--compile-transformer-layers" in features) == (
        knobs.get("COMPILE") != "0"
    )
