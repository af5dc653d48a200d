"""megatron's refusals reach the user with the flags that cause them: every ``assert`` and
``raise`` with a message in megatron-core 0.19.2's ``validate_args`` and the configs'
``__post_init__`` is described with a flag or an environment variable (its own words, the table
of messages, or the flags its statement and the conditions around it read); and the fork's own
messages that named the wrong thing or carried the wrong prefix."""

import ast
import io
import linecache
import os
import re
import subprocess
import sys

import megatron.training.arguments as megatron_arguments
import pytest

from megatron.patchset.core import dry_run, preflight
from tests.unit.conftest import ROOT, tiny_argv

MEGATRON = os.path.dirname(os.path.dirname(megatron_arguments.__file__))
# (file under megatron/, functions whose refusals a launch and the dry-run surface)
VALIDATION = (
    ("training/arguments.py", ("validate_args",)),
    ("core/transformer/transformer_config.py", ("__post_init__",)),
    ("core/model_parallel_config.py", ("__post_init__",)),
)
NAMES_A_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]+|\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")
KINDS = {
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "AssertionError": AssertionError,
    "NotImplementedError": NotImplementedError,
    "TypeError": TypeError,
}


def _literal(node) -> str:
    """The text of a message expression, with ``<value>`` for its formatted parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<value>" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal(node.left) + _literal(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _literal(node.left)
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "format":
        return _literal(node.func.value)
    return "<value>"


def refusals():
    """(path, statement, message, exception type) of every assert and raise with a message."""
    for relative, functions in VALIDATION:
        path = os.path.join(MEGATRON, relative)
        with open(path) as handle:
            tree = ast.parse(handle.read())
        for function in ast.walk(tree):
            if not (isinstance(function, ast.FunctionDef) and function.name in functions):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Assert) and node.msg is not None:
                    yield path, node, _literal(node.msg), AssertionError
                elif (
                    isinstance(node, ast.Raise)
                    and isinstance(node.exc, ast.Call)
                    and node.exc.args
                    and getattr(node.exc.func, "id", None) in KINDS
                ):
                    yield path, node, _literal(node.exc.args[0]), KINDS[node.exc.func.id]


def describe(path, node, message, kind):
    where = (
        "megatron/" + path.rsplit("/megatron/", 1)[1],
        node.lineno,
        linecache.getline(path, node.lineno).strip(),
        preflight.statement_context(path, node.lineno, node.end_lineno),
    )
    return preflight.describe_refusal(message.strip(), kind, where)


def test_every_refusal_of_megatrons_validation_names_a_flag_or_a_variable():
    found = list(refusals())
    assert len(found) > 300  # validate_args and the configs, not a parse that found nothing
    unnamed = [
        f"{node.lineno}: {text}"
        for path, node, message, kind in found
        if not NAMES_A_FLAG.search(text := describe(path, node, message, kind))
    ]
    assert unnamed == []


def test_the_table_matches_megatrons_messages_and_names_real_flags():
    from megatron.patchset.core.preflight import _flag_of_dest

    known = set(_flag_of_dest().values())
    messages = [message for _, _, message, _ in refusals()]
    for pattern, causes in preflight.MEGATRON_REFUSALS:
        assert any(re.search(pattern, m) for m in messages), pattern  # still megatron's words
        for cause in causes:
            for flag in re.findall(r"--[a-z0-9-]+", cause):
                assert flag in known, (pattern, flag)


def test_the_statement_context_is_the_statement_and_its_conditions(tmp_path):
    source = tmp_path / "checks.py"
    source.write_text(
        "def validate(args):\n"
        "    if args.use_megatron_fsdp:\n"
        "        if args.data_parallel_sharding_strategy == 'optim_grads_params':\n"
        "            assert args.check_weight_hash_across_dp_replicas_interval is None\n"
        "\n"
        "        assert env != '1', 'FSDP needs more connections'\n"
    )
    context = preflight.statement_context(str(source), 6)
    assert "args.use_megatron_fsdp" in context
    assert "check_weight_hash" not in context and "sharding_strategy" not in context
    assert preflight.checked_flags(context) == ["--use-megatron-fsdp"]


def dry(argv, env=None):
    environ = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    environ.update(env or {})
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--dry-run", *argv],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_full_recompute_with_layer_graphs_names_the_flags():
    code, out, err = dry(
        tiny_argv(
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
            "--cuda-graph-impl",
            "transformer_engine",
        )
    )
    assert code == 2
    assert out.strip().splitlines()[-2] == (
        "megatron-core refused the flags: full recompute is only supported with full iteration "
        "CUDA graph. (caused by --recompute-granularity full, --cuda-graph-impl local or "
        "transformer_engine)"
    )
    assert "Traceback" not in err


def test_fsdp_with_one_device_connection_names_the_variable_not_another_flag():
    code, out, _ = dry(
        tiny_argv(
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy",
            "optim_grads_params",
            "--ckpt-format",
            "fsdp_dtensor",
        ),
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    )
    message = out.strip().splitlines()[-2]
    assert code == 2
    assert "(caused by CUDA_DEVICE_MAX_CONNECTIONS=1, --use-megatron-fsdp)" in message
    assert "--check-weight-hash-across-dp-replicas-interval" not in message


def test_an_unknown_rule_to_skip_is_named_without_a_build_failure_prefix(monkeypatch):
    monkeypatch.setenv("MEGATRON_PATCHSET_SKIP_RULES", "sizes-positve")
    out = io.StringIO()
    assert dry_run.run(tiny_argv(), out=out) == 2
    message = out.getvalue().strip().splitlines()[-2]
    assert message == (
        "megatron-patchset: MEGATRON_PATCHSET_SKIP_RULES names unknown rules: sizes-positve "
        "(sizes-positve: did you mean sizes-positive?). A rule's name is the bracketed word before "
        "its message, e.g. [sizes-positive]."
    )


def test_the_memory_estimate_says_why_it_is_unavailable_for_a_tokenizer_not_here():
    from megatron.patchset.core import argsfile

    argv = argsfile.remove(argsfile.remove(tiny_argv(), "--tokenizer-type"), "--vocab-size")
    argv += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/no-such-model"]
    out = io.StringIO()
    assert dry_run.run(argv, out=out) == 0, out.getvalue()
    assert (
        "theoretical memory estimate unavailable: the vocabulary size is not known here (the "
        "tokenizer --tokenizer-model org/no-such-model is not on this machine)"
    ) in out.getvalue()
    assert "TypeError" not in out.getvalue()


@pytest.mark.parametrize("below", ["", "sub"])
def test_export_to_a_file_is_one_line_and_exit_2(tmp_path, below):
    target = tmp_path / "a-file"
    target.write_text("")
    out = target / below if below else target
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron.patchset",
            "export",
            "--megatron-lm",
            MEGATRON + "/..",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "warn" not in line.lower()]
    problem = "is a file, not a folder" if not below else f"{target} is a file"
    assert lines[-1] == f"python -m megatron.patchset export: --out {out}: {problem}"
    assert "Traceback" not in proc.stderr


def test_local_cuda_graphs_are_counted_without_the_launchs_rng_tracker():
    """Building the model for the parameter count with megatron's local CUDA graphs failed with
    "RNG tracker does not support cudagraphs!" (the tracker a launch sets up), naming no flag; the
    graphs hold no parameters and are left out of the count."""
    out = io.StringIO()
    assert dry_run.run(tiny_argv("--cuda-graph-impl", "local"), out=out) == 0, out.getvalue()
    assert "parameters: 15,345,920 in total" in out.getvalue()
