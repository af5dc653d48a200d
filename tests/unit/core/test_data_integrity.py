"""The data a run reads, checked before megatron builds its datasets: a .bin shorter than its .idx
describes (megatron's reader stops with a ValueError traceback), a truncated .idx, and blend
weights megatron's blended dataset asserts on (negative, zero, nan, inf). Each is refused by the
data-files rule with the flag and the file; megatron itself fails on the same inputs."""

import io
import os
import shutil

import pytest

from megatron.patchset.core import argsfile, dry_run
from megatron.patchset.core.layout_rules.data import index_size_problem
from tests.unit.conftest import failures, tiny_argv
from tests.unit.support.indexed_data import write_dataset


def data_argv(*extra):
    return argsfile.remove(tiny_argv(), "--mock-data") + list(extra)


@pytest.fixture
def prefix(tmp_path):
    return write_dataset(tmp_path / "text", documents=64, length=300)


def test_a_whole_dataset_has_no_size_problem(prefix):
    assert index_size_problem(prefix) is None
    assert failures(data_argv("--data-path", prefix)) == {}


def test_a_short_bin_is_refused_naming_it(prefix):
    whole = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", whole - 2)
    got = failures(data_argv("--data-path", prefix))["data-files"]
    assert got.startswith(f"--data-path {prefix}: {prefix}.bin is {whole - 2:,} bytes, but ")
    assert f"{prefix}.idx places its last sequence at bytes {whole - 600:,}-{whole:,}" in got
    # megatron's own reader fails on it
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    with pytest.raises(ValueError):
        dataset[len(dataset) - 1]


def test_a_bin_of_another_index_is_refused(tmp_path, prefix):
    small = write_dataset(tmp_path / "small", documents=4, length=10)
    shutil.copy(small + ".bin", prefix + ".bin")
    assert "(truncated, or the .bin of another index)" in index_size_problem(prefix)


def test_a_truncated_idx_is_refused(prefix):
    os.truncate(prefix + ".idx", 100)
    problem = index_size_problem(prefix)
    assert problem.startswith(f"{prefix}.idx is 100 bytes, but its header counts 64 sequences")
    os.truncate(prefix + ".idx", 20)
    assert index_size_problem(prefix) == f"{prefix}.idx ends inside its header (truncated)"


@pytest.mark.parametrize("weight", ["-1", "0", "nan", "inf"])
def test_a_blend_weight_megatron_rejects_is_refused_by_the_flag(tmp_path, prefix, weight):
    other = write_dataset(tmp_path / "other", seed=1)
    got = failures(data_argv("--data-path", weight, prefix, "0.5", other))["data-files"]
    assert got == (
        f"--data-path: the blend weight {weight} (of {prefix}) must be positive and finite "
        "(megatron samples each dataset in proportion to its weight; leave a dataset out rather "
        "than weighting it 0)."
    )


def test_all_zero_weights_are_refused_together(tmp_path, prefix):
    other = write_dataset(tmp_path / "other", seed=1)
    got = failures(data_argv("--data-path", "0", prefix, "0", other))["data-files"]
    assert f"the blend weights 0 (of {prefix}), 0 (of {other}) must be" in got


def test_blend_weights_in_a_data_args_file_are_checked(tmp_path, prefix):
    path = tmp_path / "blend.txt"
    path.write_text(f"-0.5 {prefix} 1 {prefix}\n")
    got = failures(data_argv("--data-args-path", str(path)))["data-files"]
    assert got.startswith(f"--data-args-path {path}: the blend weight -0.5")


def test_the_dry_run_refuses_a_short_bin_in_one_message(prefix):
    os.truncate(prefix + ".bin", 1000)
    out = io.StringIO()
    code = dry_run.run(data_argv("--data-path", prefix), out=out)
    lines = out.getvalue().strip().splitlines()
    assert code == 2 and lines[-1] == "dry-run: INVALID"
    assert "[data-files]" in lines[-2] and f"{prefix}.bin is 1,000 bytes" in lines[-2]
    assert "Traceback" not in out.getvalue()
