"""Every launcher under examples/: real data through DATA_PATH in place of the config's mock data,
the command its DRY_RUN=1 mode prints and checks, knob values refused before anything runs, and
dry-runs that need neither a GPU nor nvidia-smi."""

import os
import re
import sys

import pytest

from tests.unit.conftest import ROOT, dry_run_example, run_example
from tests.unit.examples.conftest import LAUNCHERS, LOCAL, dry_run_command

# The launchers export what their launch needs (CUDA_DEVICE_MAX_CONNECTIONS above all): none of it
# may come from the calling shell.
DROP = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP",
    "NGPUS",
    "DATA_PATH",
    "TOKENIZER_TYPE",
    "TOKENIZER_MODEL",
    "VOCAB_FILE",
    "MERGE_FILE",
    "EXTRA",
)


def checked(proc):
    """The argv of a launcher's dry-run that passed."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("dry-run: OK"), proc.stdout[-3000:]
    argv = dry_run_command(proc.stdout)
    assert argv[1:4] == ["pretrain_gpt.py", "--dry-run", "--dry-run-world-size"]
    return argv


def values(argv, flag, count=1):
    """The ``count`` words after the only ``flag`` of argv."""
    assert argv.count(flag) == 1, argv
    start = argv.index(flag) + 1
    return argv[start : start + count]


@pytest.mark.parametrize("script", LAUNCHERS)
def test_data_path_replaces_the_mock_data(script, indexed_dataset):
    prefix = indexed_dataset()
    proc = dry_run_example(script, drop=DROP, DATA_PATH=prefix, TOKENIZER_TYPE="NullTokenizer")
    argv = checked(proc)
    assert argv[0] == sys.executable
    assert f" --data-path {prefix} " in proc.stdout
    assert values(argv, "--data-path", 2) == [prefix, "--split"]
    assert "--mock-data" not in argv
    assert values(argv, "--tokenizer-type") == ["NullTokenizer"]
    assert argv.count("--vocab-size") == 1  # the config's, for the NullTokenizer
    assert values(argv, "--split") == ["990,8,2"]


@pytest.mark.parametrize(
    "script",
    ["examples/pretrain_moe_small_batch.sh", "examples/slurm/pretrain_moe_p2p_overlap.sbatch"],
)
def test_a_blend_of_two_datasets_and_extra_flags_last(script, indexed_dataset):
    first, second = indexed_dataset("first"), indexed_dataset("second")
    proc = dry_run_example(
        script,
        drop=DROP,
        DATA_PATH=f"0.3 {first} 0.7 {second}",
        TOKENIZER_TYPE="NullTokenizer",
        EXTRA="--log-interval 5",
    )
    argv = checked(proc)
    assert values(argv, "--data-path", 4) == ["0.3", first, "0.7", second]
    assert "--mock-data" not in argv
    assert argv[-2:] == ["--log-interval", "5"]


def test_data_path_defaults_to_the_hugging_face_tokenizer(indexed_dataset):
    proc = dry_run_example(
        "examples/train_tiny_moe.sh",
        drop=DROP,
        NGPUS="1",
        DATA_PATH=indexed_dataset(),
        HF_HUB_OFFLINE="1",
    )
    argv = checked(proc)
    assert values(argv, "--tokenizer-type") == ["HuggingFaceTokenizer"]
    assert values(argv, "--tokenizer-model") == ["Qwen/Qwen3-30B-A3B"]
    assert "--vocab-size" not in argv and "--mock-data" not in argv


def test_slurm_dry_run_with_tensor_parallelism_has_the_launch_environment():
    """megatron refuses TP > 1 unless CUDA_DEVICE_MAX_CONNECTIONS=1, which the script exports for
    its launch: its dry-run must see it too."""
    proc = dry_run_example("examples/slurm/pretrain_moe.sbatch", drop=DROP, TP="2")
    argv = checked(proc)
    assert "tensor model parallel (TP) ........ 2" in proc.stdout
    assert "--sequence-parallel" in argv
    assert "--mock-data" in argv  # no DATA_PATH: the config's mock data


def test_compile_dry_run_needs_no_nvidia_smi(path_without_nvidia_smi):
    proc = dry_run_example(
        "examples/pretrain_moe_compile.sh", drop=DROP, PATH=path_without_nvidia_smi
    )
    argv = checked(proc)
    assert "NGPUS is not set and nvidia-smi is not on PATH: using NGPUS=1" in proc.stdout
    assert values(argv, "--dry-run-world-size") == ["1"]
    assert "world size ........................ 1" in proc.stdout


def test_quick_start_honours_dry_run():
    proc = dry_run_example("examples/train_tiny_moe.sh", drop=DROP, NGPUS="2")
    argv = checked(proc)
    assert "No NVIDIA GPU visible" not in proc.stdout
    assert values(argv, "--dry-run-world-size") == ["2"]
    assert values(argv, "--expert-model-parallel-size") == ["2"]
    assert "expert model parallel (EP) ........ 2" in proc.stdout


@pytest.mark.parametrize(
    "script, knobs, line",
    [
        (
            "examples/pretrain_moe_fsdp_cuda_graphs.sh",
            {"GRAPHS": "foo"},
            "GRAPHS must be 0 or 1 (got 'foo')",
        ),
        (
            "examples/pretrain_moe_compile.sh",
            {"NGPUS": "two"},
            "NGPUS must be a whole number >= 1 (got 'two')",
        ),
        (
            "examples/pretrain_moe_p2p_overlap.sh",
            {"TP": "1.5"},
            "TP must be a whole number >= 1 (got '1.5')",
        ),
        ("examples/train_tiny_moe.sh", {"EP": "0"}, "EP must be a whole number >= 1 (got '0')"),
        (
            "examples/slurm/pretrain_moe.sbatch",
            {"NODES": "0"},
            "NODES must be a whole number >= 1 (got '0')",
        ),
        (
            "examples/slurm/pretrain_moe_small_batch.sbatch",
            {"GRAPHS": "foo"},
            "GRAPHS must be full, layer or none (got 'foo')",
        ),
        (
            "examples/pretrain_moe_deepep.sh",
            {"BACKEND": "foo"},
            "BACKEND must be deepep, hybridep, ncclep or alltoall (got 'foo')",
        ),
        (
            "examples/pretrain_moe_paged_stash.sh",
            {"CAPACITY": "foo"},
            "CAPACITY must be a number >= 0 (got 'foo')",
        ),
        (
            "examples/pretrain_moe_small_batch.sh",
            {"DRY_RUN": "foo"},
            "DRY_RUN must be 0 or 1 (got 'foo')",
        ),
        (
            "examples/slurm/pretrain_moe_p2p_overlap.sbatch",
            {"DATA_PATH": "/data/text", "TOKENIZER_TYPE": "foo"},
            "TOKENIZER_TYPE must be HuggingFaceTokenizer, GPT2BPETokenizer, "
            "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or "
            "NullTokenizer (got 'foo')",
        ),
        (
            "examples/pretrain_moe_small_batch.sh",
            {"DATA_PATH": "/data/text", "TOKENIZER_TYPE": "GPT2BPETokenizer"},
            "VOCAB_FILE must be set for TOKENIZER_TYPE=GPT2BPETokenizer (a file)",
        ),
    ],
)
def test_a_bad_knob_stops_the_launcher_before_anything_runs(script, knobs, line):
    proc = run_example(script, {"DRY_RUN": "1", **knobs}, drop=DROP)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [line]


def test_slurm_script_outside_a_job_says_how_to_run_it():
    proc = run_example("examples/slurm/pretrain_moe_fsdp_cuda_graphs.sbatch", drop=DROP)
    assert proc.returncode == 2
    assert "Not inside a Slurm job: submit the script with sbatch, or set DRY_RUN=1" in proc.stderr


def test_slurm_script_default_interpreter_is_the_local_one():
    """PYTHON unset: the repository's .venv/bin/python when there is one, else python3."""
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    expected = ".venv/bin/python" if os.access(venv, os.X_OK) else "python3"
    proc = dry_run_example("examples/slurm/pretrain_moe.sbatch", drop=DROP, PYTHON="")
    assert dry_run_command(proc.stdout)[0] == expected


@pytest.mark.parametrize("script", ["examples/slurm/pretrain_moe_small_batch.sbatch", LOCAL[-1]])
def test_an_interpreter_without_torch_and_megatron_is_refused_with_how_to_set_one_up(
    script, tmp_path
):
    """PYTHON names an interpreter that cannot import torch and megatron.core (here this one
    without its site-packages): one line naming PYTHON and the way to install the stack, exit 2,
    before anything runs."""
    bare = tmp_path / "python3"
    bare.write_text(f'#!/bin/bash\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    proc = run_example(script, {"DRY_RUN": "1", "PYTHON": str(bare)}, drop=DROP)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"PYTHON={bare} cannot import torch and megatron.core")
    assert "pip install -e '.[te]'" in proc.stderr and len(proc.stderr.splitlines()) == 1


def header(script):
    """The comment block at the top of a launcher, without its #SBATCH lines."""
    with open(os.path.join(ROOT, script)) as handle:
        lines = handle.read().splitlines()[1:]
    block = []
    for line in lines:
        if not line.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            block.append(line)
    return "\n".join(block)


@pytest.mark.parametrize("script", LAUNCHERS)
def test_header_documents_the_data_and_nothing_but_the_product(script):
    text = header(script)
    assert "DATA_PATH" in text and "--data-path" in text
    assert "DRY_RUN=1" in text
    history = "|".join(("iss" + "ue", "sess" + "ion", "we", "our", "us"))  # not in this file's text
    assert not re.search(rf"\b({history})\b|#\d", text, re.IGNORECASE), text
    assert not re.search(r"\bI\b", text), text


@pytest.mark.parametrize("script", LOCAL)
def test_local_launchers_share_one_library(script):
    with open(os.path.join(ROOT, script)) as handle:
        text = handle.read()
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/lib/launch.sh"' in text
    assert "torch.distributed.run" not in text


@pytest.fixture
def recorder(tmp_path):
    """A stand-in for the interpreter, srun and scontrol: each call but the launcher's questions to
    the real interpreter (its packages, its recipe's flags) appends its program name and
    arguments to a log (one line, fields separated by \\x1f); returns (PYTHON, PATH, calls)."""
    folder = tmp_path / "fake"
    folder.mkdir()
    real_python = sys.executable
    log = tmp_path / "calls.log"
    stub = folder / "python"
    stub.write_text(
        "#!/bin/bash\n"
        'if [ "$(basename "$0")" = scontrol ]; then echo node1; exit 0; fi\n'
        # the launcher's own questions (its interpreter's packages, its recipe's flags) are answered
        f'case "$1 $2" in "-m megatron.patchset"|"-c "*find_spec*) exec {real_python} "$@";; esac\n'
        f'printf \'%s\\x1f\' "$(basename "$0")" "$@" >> {log}\n'
        f"echo >> {log}\n"
    )
    stub.chmod(0o755)
    for name in ("srun", "scontrol"):
        (folder / name).symlink_to(stub)

    def calls():
        return [line.split("\x1f")[:-1] for line in log.read_text().splitlines()]

    return str(stub), f"{folder}{os.pathsep}{os.environ['PATH']}", calls


def flags_after_the_program(argv):
    return argv[argv.index("pretrain_gpt.py") + 1 :]


@pytest.mark.parametrize("script", LAUNCHERS)
def test_launch_runs_the_flags_the_dry_run_checks(script, recorder, tmp_path):
    """The launch (torchrun here, srun in a Slurm job) gets the very flags that DRY_RUN=1 prints
    and checks."""
    python, path, calls = recorder
    knobs = {"PYTHON": python, "PATH": path, "NGPUS": "2", "EXTRA": "--log-interval 5"}
    knobs.update(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node1", SLURM_NNODES="1")
    knobs["CHECKPOINT_DIR"] = str(tmp_path / "checkpoints")
    dry = run_example(script, {**knobs, "DRY_RUN": "1"}, drop=DROP)
    launch = run_example(script, knobs, drop=DROP)
    assert dry.returncode == 0 and launch.returncode == 0, dry.stderr + launch.stderr
    checked, *launched = calls()
    printed = dry_run_command(dry.stdout)
    assert printed == [python, *checked[1:]]
    assert checked[1:5] == ["pretrain_gpt.py", "--dry-run", "--dry-run-world-size", printed[4]]
    flags = checked[5:]
    assert flags[-2:] == ["--log-interval", "5"]
    *probes, torchrun = launched
    if script.endswith(".sbatch"):
        # the job checks the flags once more, then srun starts one torchrun per node
        assert probes == [checked] and torchrun[0] == "srun"
    else:
        tiny = script.endswith("train_tiny_moe.sh")  # it asks whether TransformerEngine imports
        assert probes == ([["python", "-c", "import transformer_engine.pytorch"]] if tiny else [])
        assert torchrun[:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
    assert torchrun[torchrun.index("torch.distributed.run") - 1] == "-m"
    assert flags_after_the_program(torchrun) == flags
