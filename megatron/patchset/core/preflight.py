"""What a launch checks before megatron's own set-up, shared by ``pretrain_gpt.py`` and
``--dry-run``: the launcher's environment variables, megatron's argument validation with its
failures turned into one line that names the flags, and the GPU.

Every failure is a :class:`PreflightError` (or the rule engine's ``PatchsetArgumentError``): one
message, no traceback, a non-zero exit.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
import traceback
from collections.abc import Callable
from typing import Any

from megatron.patchset.core.errors import PatchsetError

# (variable, least value) that torchrun, Slurm launchers and megatron read as integers.
INTEGER_ENV = (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1))


class PreflightError(PatchsetError):
    """The launch cannot start; the message says why and how to fix it."""


def environment_problems(environ: dict | None = None) -> list[str]:
    """Launcher variables that megatron reads with int() and that would fail there."""
    environ = os.environ if environ is None else environ
    problems = []
    for name, least in INTEGER_ENV:
        value = environ.get(name)
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            problems.append(f"{name}={value!r} is not an integer")
            continue
        if number < least:
            problems.append(f"{name}={number} must be {least} or more")
    return problems


def check_environment(environ: dict | None = None) -> None:
    """The launcher's variables (:func:`environment_problems`) and ``MEGATRON_PATCHSET``."""
    problems = environment_problems(environ)
    if problems:
        raise PreflightError(
            "megatron-patchset: launcher environment: "
            + "; ".join(problems)
            + " (torchrun and srun set these; unset or correct them)."
        )
    from megatron.patchset.core import registry

    registry.upstream_mode(environ)  # raises for a value it does not know


def _as_flags(text: str) -> str:
    """``args.hidden_size`` in megatron's source -> ``--hidden-size``."""
    return re.sub(r"\bargs\.([a-z][a-z0-9_]*)", lambda m: "--" + m.group(1).replace("_", "-"), text)


@functools.cache
def _flag_of_dest() -> dict[str, str]:
    """megatron's (and the fork's) argument names -> their flags, e.g. ``hidden_size`` ->
    ``--hidden-size``."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron.patchset.core.flags import add_patchset_args

    parser = add_patchset_args(add_megatron_arguments(argparse.ArgumentParser(add_help=False)))
    return {
        action.dest: max(action.option_strings, key=len)
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


def _name_flags(message: str) -> str:
    """megatron's messages name config fields (``overlap_moe_expert_parallel_comm``): add the
    flag each comes from."""
    flags = _flag_of_dest()
    seen: set[str] = set()

    def add(match):
        word = match.group(0)
        flag = flags.get(word)
        if flag is None or word in seen:
            return word
        seen.add(word)
        return f"{word} ({flag})"

    return re.sub(r"(?<![-\w])[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", add, message)


# megatron-core 0.19.2's refusals whose message, statement and enclosing conditions name no flag
# (or another one than the cause): a regular expression of the message -> the flags or
# environment variables that cause it.
MEGATRON_REFUSALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        r"full recompute is only supported with full iteration CUDA graph",
        ("--recompute-granularity full", "--cuda-graph-impl local or transformer_engine"),
    ),
    (
        r"bias_activation_fusion is True",
        (
            "the bias-activation fusion (on unless --no-bias-swiglu-fusion, --no-bias-gelu-fusion)",
            "--swiglu",
            "--quick-geglu",
            "--disable-bias-linear",
        ),
    ),
    (r"Storing activation input in FP8 is supported only for SwiGLU", ("--swiglu",)),
    (
        r"FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS",
        ("CUDA_DEVICE_MAX_CONNECTIONS=1", "--use-torch-fsdp2"),
    ),
    (
        r"FSDP requires CUDA_DEVICE_MAX_CONNECTIONS",
        ("CUDA_DEVICE_MAX_CONNECTIONS=1", "--use-megatron-fsdp"),
    ),
)


def refusal_causes(message: str) -> tuple[str, ...] | None:
    """The flags :data:`MEGATRON_REFUSALS` gives for one of megatron's messages, or None."""
    for pattern, causes in MEGATRON_REFUSALS:
        if re.search(pattern, message):
            return causes
    return None


@functools.cache
def _source_tree(filename: str) -> tuple[str, ast.Module] | None:
    try:
        with open(filename) as handle:
            source = handle.read()
        return source, ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None


def statement_context(filename: str, lineno: int, end_lineno: int | None = None) -> str:
    """The statement at ``lineno`` (to ``end_lineno``) and the conditions of the ``if`` blocks
    around it: what megatron tested when it refused."""
    last = end_lineno or lineno
    statement = "".join(linecache.getline(filename, n) for n in range(lineno, last + 1))
    parsed = _source_tree(filename)
    if parsed is None:
        return statement
    source, tree = parsed
    conditions = [
        ast.get_source_segment(source, node.test) or ""
        for node in ast.walk(tree)
        if isinstance(node, (ast.If, ast.While))
        and node.lineno < lineno <= (node.end_lineno or 0)
        and not node.test.lineno <= lineno <= (node.test.end_lineno or node.test.lineno)
    ]
    return "\n".join(conditions + [statement])


def _megatron_frame(exc: BaseException) -> tuple[str, int, str, str] | None:
    """(file relative to its package root, line, source line, the statement with the conditions
    around it) of the innermost megatron frame."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
    if not frames:
        return None
    frame = frames[-1]
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    context = statement_context(frame.filename, frame.lineno, frame.end_lineno)
    short = "megatron/" + frame.filename.rsplit("/megatron/", 1)[1]
    return short, frame.lineno, source, context


def checked_flags(context: str) -> list[str]:
    """The flags of the ``args.<name>`` (validate_args) and ``self.<name>`` (a config's
    ``__post_init__``) that ``context`` reads, where a flag sets that name."""
    flags = _flag_of_dest()
    found = {
        flags.get(name, "--" + name.replace("_", "-"))
        for name in re.findall(r"\bargs\.([a-z][a-z0-9_]*)", context)
    }
    found |= {
        flags[_CONFIG_FIELDS.get(name, name)]
        for name in re.findall(r"\bself\.([a-z][a-z0-9_]*)", context)
        if _CONFIG_FIELDS.get(name, name) in flags
    }
    return sorted(found)


# TransformerConfig fields that megatron's core_transformer_config_from_args fills from a flag of
# another name: field -> argparse dest.
_CONFIG_FIELDS = {
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "fp8_param": "fp8_param_gather",
    "fp4_param": "fp4_param_gather",
}


def describe_refusal(
    message: str, kind: type[BaseException], where: tuple[str, int, str, str] | None
) -> str:
    """One line for a refusal of megatron's argument validation or config: its own message with
    the flags it names, those :data:`MEGATRON_REFUSALS` gives, or those the failing statement
    checks; for a bare ``assert``, the failing condition with megatron's ``args.x`` shown as the
    flag ``--x``. ``where`` is :func:`_megatron_frame`'s answer."""
    if message and not issubclass(kind, (ZeroDivisionError, TypeError, KeyError, IndexError)):
        named = _name_flags(message)
        causes = refusal_causes(message)
        if causes:
            named += f" (caused by {', '.join(causes)})"
        elif "--" not in named and where is not None:
            checked = checked_flags(where[3])
            if checked:
                named += f" (megatron checks {', '.join(checked)} at {where[0]}:{where[1]})"
        return f"megatron-core refused the flags: {named}"
    if where is None:
        return f"megatron-core refused the flags: {kind.__name__}: {message or '(no message)'}"
    path, line, source, context = where
    detail = f" ({kind.__name__}: {message})" if message else ""
    checked = [f for f in checked_flags(context) if f not in _as_flags(source)]
    also = f"; it also checks {', '.join(checked)}" if checked else ""
    return (
        f"megatron-core refused the flags at {path}:{line}: `{_as_flags(source)}`{detail}"
        f"{also}. Check the flags named there."
    )


def describe_megatron_failure(exc: BaseException) -> str:
    """One line for an exception raised by megatron's argument validation or config (see
    :func:`describe_refusal`)."""
    return describe_refusal(str(exc).strip(), type(exc), _megatron_frame(exc))


def megatron_validated(validate: Callable[[], Any]) -> Any:
    """Run megatron's argument validation (or config construction); a failure becomes a
    :class:`PreflightError` with :func:`describe_megatron_failure`'s message."""
    try:
        return validate()
    except (
        AssertionError,
        ValueError,
        RuntimeError,
        NotImplementedError,
        ZeroDivisionError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
    ) as exc:
        raise PreflightError(describe_megatron_failure(exc)) from exc


def require_gpu() -> None:
    """Training needs a CUDA GPU; say so before megatron asks the driver."""
    import torch

    if not torch.cuda.is_available():
        raise PreflightError(
            "megatron-patchset: training needs an NVIDIA GPU and none is visible (CUDA_VISIBLE_"
            "DEVICES, the driver). Run with --dry-run to check the flags on this machine."
        )
