"""A failed variant shows its cause: the training process's error line in torchrun's output, not
torchrun's report on the failure that ends the output (bench.py and profile_step.py)."""

import bench
import profile_step
import pytest

from tests.unit.conftest import TINY

COMMAND = "/usr/bin/python3 -m torch.distributed.run --standalone --nproc-per-node=2 x.py --bf16"
START = [
    COMMAND,
    "W1127 10:11:12.345000 4242 torch/distributed/run.py:803] ",
    "W1127 10:11:12.345000 4242 torch/distributed/run.py:803] *****************************",
    "W1127 10:11:12.345000 4242 torch/distributed/run.py:803] Setting OMP_NUM_THREADS "
    "environment variable for each process to be 1 in default, to avoid your system being "
    "overloaded, please further tune the variable for optimal performance in your application "
    "as needed.",
    "W1127 10:11:12.345000 4242 torch/distributed/run.py:803] *****************************",
    "using world size: 2, data-parallel size: 2, context-parallel size: 1",
    "------------------------ arguments ------------------------",
    "  accumulate_allreduce_grads_in_fp32 .............. False",
    "  adam_beta1 ...................................... 0.9",
    "-------------------- end of arguments ---------------------",
    "megatron-patchset: Adam is torch.optim.AdamW (fused, capturable)",
    " > learning rate decay style: cosine",
    "> building GPT model ...",
    " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 41222400",
    "[rank1]:[W1127 10:11:20.100000 4250 ProcessGroupNCCL.cpp:4718] using GPU 1 as device",
]
# Rank 0's traceback: its exception line is line 24 of the output.
RAISED = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/repo/pretrain_gpt.py", line 360, in <module>',
    "[rank0]:     pretrain(",
    '[rank0]:   File "/site/megatron/training/training.py", line 700, in pretrain',
    "[rank0]:     model, optimizer, opt_param_scheduler = setup_model_and_optimizer(",
    "[rank1]:[W1127 10:11:21.000000 4250 ProcessGroupNCCL.cpp:1476] Warning: destroy_process_"
    "group() was not called before program exit",
    '[rank0]:   File "/repo/megatron/patchset/features/grouped_mm/linears.py", line 88, in stack',
    "[rank0]:     raise ValueError(f'experts {n} != {m}')",
    "[rank0]: ValueError: experts 4 != 8 in layer 3",
]
END = [
    "W1127 10:11:25.000000 4242 torch/distributed/elastic/multiprocessing/api.py:908] Sending "
    "process 4251 closing signal SIGTERM",
    "[rank1]:[W1127 10:11:25.100000 4251 ProcessGroupNCCL.cpp:1476] Warning: destroy_process_"
    "group() was not called before program exit",
    "E1127 10:11:25.500000 4242 torch/distributed/elastic/multiprocessing/api.py:882] failed "
    "(exitcode: 1) local_rank: 0 (pid: 4250) of binary: /usr/bin/python3",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File "<frozen runpy>", line 88, in _run_code',
    '  File "/site/torch/distributed/run.py", line 946, in <module>',
    "    main()",
    '  File "/site/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 357, in '
    "wrapper",
    "    return f(*args, **kwargs)",
    '  File "/site/torch/distributed/run.py", line 942, in main',
    "    run(args)",
    '  File "/site/torch/distributed/run.py", line 933, in run',
    "    elastic_launch(",
    '  File "/site/torch/distributed/launcher/api.py", line 151, in __call__',
    "    return launch_agent(self._config, self._entrypoint, list(args))",
    '  File "/site/torch/distributed/launcher/api.py", line 292, in launch_agent',
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "x.py FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "  <NO_OTHER_FAILURES>",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-27_10:11:25",
    "  host      : gpu-host",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : 1 (pid: 4250)",
    "  error_file: <N/A>",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    "============================================================",
]
REFUSED = [
    "megatron-patchset: 2 invalid flag combination(s):",
    "  [grouped_mm.needs_te] --moe-grouped-gemm-impl torch needs --transformer-impl "
    "transformer_engine",
    "  [static_dispatch.ep] --moe-static-dispatch needs --expert-model-parallel-size > 1",
    "megatron-patchset: 2 invalid flag combination(s):",
    "  [grouped_mm.needs_te] --moe-grouped-gemm-impl torch needs --transformer-impl "
    "transformer_engine",
    "  [static_dispatch.ep] --moe-static-dispatch needs --expert-model-parallel-size > 1",
    "[rank0]:[W1127 10:11:21.000000 4250 ProcessGroupNCCL.cpp:1476] Warning: destroy_process_"
    "group() was not called before program exit",
]


def output(*parts):
    return "\n".join(line for part in parts for line in part) + "\n"


def test_the_cause_is_the_training_processs_exception_not_torchruns_report():
    text = output(START, RAISED, END)
    lines = text.splitlines()
    assert len(lines) == 58 and lines[23].endswith("ValueError: experts 4 != 8 in layer 3")
    assert bench.failure_cause(text) == "ValueError: experts 4 != 8 in layer 3"


def test_without_a_traceback_the_forks_refusal_is_the_cause():
    cause = bench.failure_cause(output(START, REFUSED, END))
    assert cause.splitlines() == REFUSED[:3]
    # An earlier message of the fork is no refusal: the process printed more after it.
    info = START + ["iteration 1/ 50 | lm loss: 9.1"]
    assert bench.failure_cause(output(info, END)) is None


def test_a_process_killed_by_a_signal_has_no_cause_line():
    killed = [line.replace("(exitcode: 1)", "(exitcode: -9)") for line in END]
    text = output(START, ["megatron-patchset: paged stash: 12 pages"], killed)
    assert bench.failure_cause(text) is None


def test_a_multi_line_exception_keeps_its_indented_lines():
    raised = [
        "Traceback (most recent call last):",
        '  File "/repo/pretrain_gpt.py", line 350, in <module>',
        "megatron.patchset.core.rules.PatchsetArgumentError: megatron-patchset: 1 invalid flag "
        "combination(s):",
        "  [p2p_overlap.vpp] --overlap-p2p-backward-on-comm-stream needs a virtual pipeline",
        "",
        "During handling of the above exception, another exception occurred:",
    ]
    assert bench.failure_cause(output(START, raised, END)).splitlines() == raised[2:4]


def write_log(tmp_path, name, text):
    log = tmp_path / f"{name}.log"
    log.write_text(text)
    return str(log)


def test_bench_prints_the_cause_of_a_failed_variant_and_puts_it_in_its_row(
    tmp_path, monkeypatch, capsys
):
    def fake_run(name, entry_argv, env_extra, nproc, out_dir, timeout, numa_binding=None, **_):
        return (
            1,
            str(tmp_path / f"{name}.jsonl"),
            write_log(tmp_path, name, output(START, RAISED, END)),
        )

    monkeypatch.setattr(bench, "run_variant", fake_run)
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    argv = ["--config", TINY, "--out", str(tmp_path), "--iters", "3", "--warmup", "1"]
    assert bench.main(argv + ["--peak-tflops", "790", "--variant", "fork=--flag"]) == 1
    out = capsys.readouterr().out
    assert "[bench] fork FAILED (exit 1): ValueError: experts 4 != 8 in layer 3" in out
    assert "ChildFailedError" not in out
    row = next(line for line in out.splitlines() if line.startswith("| fork"))
    assert "FAILED" in row and "ValueError: experts 4 != 8" in row


def test_without_a_cause_bench_prints_the_end_of_the_log(tmp_path, capsys):
    killed = [line.replace("(exitcode: 1)", "(exitcode: -9)") for line in END]
    log = write_log(tmp_path, "a", output(START, killed))
    assert bench.report_failure("bench", "a", 1, log) is None
    assert "last lines of" in capsys.readouterr().out
    # A run bench.py stopped at its timeout: the end of the log, whatever it holds.
    log = write_log(tmp_path, "b", output(START, REFUSED))
    assert bench.report_failure("bench", "b", 124, log) is None


def test_profile_step_prints_the_cause(tmp_path, monkeypatch, capsys):
    def fake_run(name, entry_argv, env_extra, nproc, out_dir, timeout, numa_binding=None, **_):
        return 1, str(tmp_path / "m.jsonl"), write_log(tmp_path, name, output(START, RAISED, END))

    monkeypatch.setattr(bench, "run_variant", fake_run)
    assert profile_step.main(["--config", TINY, "--out", str(tmp_path), "--warmup", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED (exit 1): ValueError: experts 4 != 8 in layer 3" in out
    assert "ChildFailedError" not in out


@pytest.mark.parametrize(
    "line, expected",
    [
        ("[default1]:KeyError: 'lm loss'", "KeyError: 'lm loss'"),
        ("[rank3]: torch.OutOfMemoryError: CUDA out of memory.", "torch.OutOfMemoryError: CUDA "),
    ],
)
def test_torchruns_prefixes_are_taken_off(line, expected):
    prefix = line[: line.index("]:") + 2]
    text = output(START, [f"{prefix} Traceback (most recent call last):", line], END)
    assert bench.failure_cause(text).startswith(expected)
