"""The GPU tier in parts (tools/ci/run_gpu_tier.sh --part N/M, tests/gpu/conftest.py): pytest's
collection of the parts of 4 is disjoint and together is every test of tests/gpu; the script runs
one part."""

import os
import subprocess
import sys

import pytest

from tests.gpu import conftest as gpu
from tests.unit.conftest import ROOT

SCRIPT = os.path.join(ROOT, "tools", "ci", "run_gpu_tier.sh")


def collect(*args):
    """Node ids of tests/gpu that pytest collects with ``args`` (no GPU needed to collect)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["tests/gpu", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_parts_of_four_are_disjoint_and_together_are_the_whole_tier(tmp_path):
    whole = collect()
    parts = [collect("--gpu-part", f"{n}/4") for n in range(1, 5)]
    assert len(whole) > 50 and all(parts)
    assert sorted(t for part in parts for t in part) == sorted(whole)  # each test exactly once
    assert all(len(set(part)) == len(part) for part in parts)
    # Whole files: a file's tests are in one part.
    files = [{t.split("::")[0] for t in part} for part in parts]
    assert sum(len(f) for f in files) == len(set().union(*files))
    # The script runs the same part of tests/gpu.
    env = dict(os.environ, PYTHON=sys.executable, REPORT_DIR=str(tmp_path / "report"))
    done = subprocess.run(
        ["bash", SCRIPT, "--part", "4/4", "--collect-only"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert f"{len(parts[3])}/{len(whole)} tests collected" in done.stdout
    assert (tmp_path / "report" / "pytest.log").exists()


def test_every_entry_of_the_parts_names_test_files_and_no_file_twice():
    files = sorted(
        os.path.relpath(os.path.join(folder, name), gpu.GPU_TESTS).replace(os.sep, "/")
        for folder, _, names in os.walk(gpu.GPU_TESTS)
        for name in names
        if name.startswith("test_") and name.endswith(".py")
    )
    for parts, table in gpu.PARTS.items():
        assert len(table) == parts
        for entries in table:
            for entry in entries:
                named = [f for f in files if f == entry or f.startswith(entry + "/")]
                assert named, f"{entry} names no test file"
        owners = {
            f: [
                n
                for n, entries in enumerate(table, 1)
                for e in entries
                if f == e or f.startswith(e + "/")
            ]
            for f in files
        }
        assert all(len(found) == 1 for found in owners.values()), owners


def test_part_numbers_for_a_table_and_for_any_other_count():
    assert gpu.part_of("test_train_tiny.py", 4) == 1
    assert gpu.part_of("features/torch_adam/test_torch_adam.py", 4) == 2
    assert gpu.part_of("features/new_feature/test_new.py", 4) == 4  # not named: the last part
    assert gpu.part_of("features/torch_adam_x/test_a.py", 4) == 4  # a prefix, not a folder
    for parts in (1, 3, 5):
        numbers = {gpu.part_of(f"test_{i}.py", parts) for i in range(40)}
        assert numbers <= set(range(1, parts + 1))
        assert gpu.part_of("test_a.py", parts) == gpu.part_of("test_a.py", parts)
    assert gpu.parse_part("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "4", "a/b", "1/0"):
        with pytest.raises(pytest.UsageError):
            gpu.parse_part(bad)


def test_the_script_refuses_a_part_that_is_not_n_of_m():
    done = subprocess.run(["bash", SCRIPT, "--part", "two"], capture_output=True, text=True)
    assert done.returncode == 2 and "--part takes N/M" in done.stderr


PROBE = """import json, os, sys
keys = ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH", "TORCHELASTIC_RUN_ID")
seen = {"argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}
with open(os.environ["MEGATRON_PATCHSET_METRICS"], "a") as handle:
    handle.write(json.dumps(seen) + "\\n")
"""


@pytest.mark.parametrize("emulate", [None, 4])
def test_a_job_runs_its_entry_as_bench_launches_a_variant(tmp_path, monkeypatch, emulate):
    """The GPU tier's runs start through bench.py's launch_spec: torchrun, or with ``emulate`` one
    process as rank 0 of that world under the fake process group; the checkout first on the path,
    the metrics file in the environment, one hardware queue unless the run's env asks for more."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    job = gpu._Job(
        tmp_path,
        "probe",
        1,
        ["--x", "1"],
        entry=[str(probe)],
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "32"} if emulate else {},
        timeout=120,
        emulate=emulate,
    )
    (seen,) = job.finish().records
    assert seen["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    if emulate:
        assert seen["argv"] == ["--x", "1", "--fake-process-group"]
        assert (seen["WORLD_SIZE"], seen["RANK"]) == ("4", "0")
        assert seen["TORCHELASTIC_RUN_ID"] is None  # no torchrun
        assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    else:
        assert seen["argv"] == ["--x", "1"]
        assert (seen["WORLD_SIZE"], seen["RANK"]) == ("1", "0")
        assert seen["TORCHELASTIC_RUN_ID"] is not None
        assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
