"""examples/pretrain_moe_deepep.sh passes --dry-run with the DeepEP and NCCL EP backends."""

import pytest


@pytest.mark.parametrize("backend", ["deepep", "ncclep"])
def test_example_launcher_flags_pass_the_dry_run(backend):
    from tests.unit.conftest import dry_run_example

    proc = dry_run_example("examples/pretrain_moe_deepep.sh", BACKEND=backend, NGPUS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "expert model parallel (EP) ........ 2" in proc.stdout
    assert (
        f"fork features enabled: flex_dispatch (--moe-flex-dispatcher-backend {backend})"
        in proc.stdout
    )
    expected = (
        "deep_ep (DeepEP 567632d" if backend == "deepep" else "flex_dispatch.ncclep_bootstrap"
    )
    assert expected in proc.stdout
    assert proc.stdout.rstrip().endswith("dry-run: OK")
