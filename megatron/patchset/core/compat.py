"""Compat patches: what running from the megatron-core wheel needs.

``compat.compile_helpers``: on rank 0, ``megatron.training.initialize`` calls
``megatron.core.datasets.utils.compile_helpers``, which runs ``make`` in the installed
``megatron/core/datasets`` folder. The megatron-core wheel ships the compiled extension
(``helpers_cpp``) but no Makefile, so upstream's call fails and exits the job. The replacement
uses the shipped extension when it imports, and otherwise builds ``helpers.cpp`` itself with the
C++ compiler and pybind11 into the same folder.

``compat.help_percent_signs``: argparse formats help strings with ``%``; megatron-core 0.19.2
takes the help of its config fields from their docstrings, one of which holds a bare ``%``, so
``--help`` fails. The patch is the upstream change ``HELP_PERCENT_CHANGE`` (exported by
``python -m megatron.patchset export --series``): the installed
``ArgumentGroupFactory._build_argparse_kwargs_from_field`` recompiled with the same edit.

``compat.checkpoint_exit_status``: megatron-core 0.19.2's checkpoint loader ends a failed load
(a tracker file it cannot parse, ``--exit-on-missing-checkpoint``, a checkpoint without its
iteration or RNG state) with a bare ``sys.exit()``, status 0, so a launcher or scheduler takes
the failure for a finished run. The replacement of the loader module's ``sys`` exits with status
1 and one line saying so; every other name is the real ``sys``. The upstream form of this fix is
the change ``CHECKPOINT_EXIT_CHANGE`` of ``export --series``: ``sys.exit(1)`` at the six bare
calls main still has (main already exits with 1 after ``--exit-on-missing-checkpoint``). The
stand-in is kept for the overlay because the calls sit in four functions, one of them
(``load_checkpoint``) bound by name in ``megatron.training.training``; it covers the six calls
and main's seventh (tests/unit/export/test_series_small.py checks that).

All three are applied before the command line is parsed (``registry.apply(None)``).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import sysconfig
import types

from megatron.patchset.core.registry import patch
from megatron.patchset.export import changes, edits

logger = logging.getLogger(__name__)


def _helpers_importable() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _build_command(folder: str) -> list[str]:
    """g++ command line that builds helpers.cpp into helpers_cpp<EXT_SUFFIX> in ``folder``."""
    import pybind11  # only needed when the wheel's extension is unusable

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return [
        os.environ.get("CXX", "g++"),
        "-O3",
        "-Wall",
        "-shared",
        "-std=c++11",
        "-fPIC",
        "-fdiagnostics-color",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{pybind11.get_include()}",
        os.path.join(folder, "helpers.cpp"),
        "-o",
        os.path.join(folder, f"helpers_cpp{suffix}"),
    ]


@patch(
    "compat.compile_helpers",
    "megatron.core.datasets.utils.compile_helpers",
    reason="the wheel ships the built dataset helpers but no Makefile, so upstream's `make` fails",
    upstream_pr="fork-only (wheel packaging)",
    kind="compat",
)
def _compile_helpers(_original):
    return compile_helpers


def compile_helpers() -> None:
    """Make sure the C++ dataset helpers are importable; build them only if they are not."""
    if _helpers_importable():
        logger.info("dataset helpers: using the compiled extension shipped with megatron-core")
        return
    folder = os.path.dirname(importlib.import_module("megatron.core.datasets").__file__)
    try:
        command = _build_command(folder)
    except ImportError:
        sys.exit(
            "megatron-patchset: megatron.core.datasets.helpers_cpp does not import and pybind11 "
            "is missing to build it: pip install pybind11"
        )
    print(f"> building dataset helpers: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0 or not _helpers_importable():
        sys.exit("megatron-patchset: failed to build megatron/core/datasets/helpers.cpp")


HELP_SOURCE = "megatron/training/argument_utils.py"
HELP_TESTS = "tests/unit_tests/test_argument_utils.py"
HELP_EDIT = edits.Replace(
    HELP_SOURCE,
    "ArgumentGroupFactory._build_argparse_kwargs_from_field",
    old='        argparse_kwargs["help"] = self.field_docstrings[attribute.name] '
    'if attribute.name in self.field_docstrings else ""\n',
    new="""\
        # argparse %-formats help strings, so a literal '%' in a docstring (e.g. "10%") must be
        # escaped for --help to work.
        help_text = self.field_docstrings.get(attribute.name, "")
        argparse_kwargs["help"] = help_text.replace("%", "%%")
""",
)

HELP_PERCENT_CHANGE = changes.UpstreamChange(
    name="help_percent_signs",
    subject="argument_utils: escape '%' in help text taken from config docstrings",
    motivation="""
        `python pretrain_gpt.py --help` fails with "ValueError: unsupported format character".
        ArgumentGroupFactory passes each dataclass field's docstring to argparse as its help,
        and argparse %-formats help strings (for %(default)s). A docstring with a literal '%'
        breaks the whole help: TransformerConfig.moe_paged_stash_buffer_size_factor_cuda says
        "1.10 = 10%)" on core_r0.19.0, and mhc_recompute_layer_num says "layer_number %
        mhc_recompute_layer_num" on main.""",
    design="""
        Double every '%' of a docstring when it becomes help text. Docstrings are plain text
        (they are read from the source, not written for argparse), so no format specifier in
        them is meant for argparse; help passed through "argparse_meta" is left as written.""",
    figures="""
        Not a performance change. With this change `python pretrain_gpt.py --help` prints the
        help on core_r0.19.0 and on main; without it both exit with the ValueError above.""",
    test_plan="""
        $ pytest tests/unit_tests/test_argument_utils.py
        $ python pretrain_gpt.py --help

        TestArgumentGroupFactoryHelpText covers a docstring with a literal '%' and the help of
        megatron's whole parser; both run on CPU.""",
    edits=(
        HELP_EDIT,
        edits.InsertAfter(
            HELP_TESTS,
            "ConfigWithLiteral",
            text='''

@dataclass
class ConfigWithPercentInDocstring:
    """Config whose field docstring holds a literal percent sign."""

    headroom: float = 1.1
    """Headroom, e.g. 10%."""
''',
        ),
        edits.InsertAfter(
            HELP_TESTS,
            "TestArgumentGroupFactoryLiteral",
            text='''

class TestArgumentGroupFactoryHelpText:
    """Test help text taken from field docstrings."""

    def test_literal_percent_sign_in_docstring(self):
        """A '%' in a docstring reaches the help as written."""
        parser = ArgumentParser()
        factory = ArgumentGroupFactory(ConfigWithPercentInDocstring)

        factory.build_group(parser, title="Test Group")

        assert "Headroom, e.g. 10%." in parser.format_help()

    def test_megatron_arguments_help_formats(self):
        """Every help string of megatron's parser survives argparse's formatting."""
        from megatron.training.arguments import add_megatron_arguments

        parser = add_megatron_arguments(ArgumentParser())

        assert "--micro-batch-size" in parser.format_help()
''',
        ),
    ),
)


@patch(
    "compat.help_percent_signs",
    "megatron.training.argument_utils.ArgumentGroupFactory._build_argparse_kwargs_from_field",
    reason="megatron-core 0.19.2 passes field docstrings to argparse as help, and the docstring of "
    "moe_paged_stash_buffer_size_factor_cuda says '10%', which argparse reads as a format "
    "character: --help fails with ValueError",
    upstream_pr="proposed",
    kind="compat",
)
def _help_percent_signs(original):
    return edits.edited_function(original, HELP_EDIT)


CHECKPOINT_SOURCE = "megatron/training/checkpointing.py"
CHECKPOINT_TESTS = "tests/unit_tests/test_checkpointing.py"


def _exit_one(definition: str, before: str, after: str = "") -> edits.Replace:
    """``sys.exit()`` -> ``sys.exit(1)`` in ``definition``, the call found by the text around it."""
    return edits.Replace(
        CHECKPOINT_SOURCE,
        definition,
        old=f"{before}sys.exit()\n{after}",
        new=f"{before}sys.exit(1)\n{after}",
    )


# Every bare sys.exit() of checkpointing.py that main still has. The sixth one of 0.19.x, after
# "--exit-on-missing-checkpoint set ... exiting", is sys.exit(1) on main already, so the change
# leaves it out; the overlay's stand-in below covers it on 0.19.2.
CHECKPOINT_EXIT_EDITS = (
    _exit_one("read_metadata", "                "),
    _exit_one(
        "fix_query_key_value_ordering",
        "                    ",
        "                param.data.copy_(fixed_param)\n            if name",
    ),
    _exit_one(
        "fix_query_key_value_ordering",
        "                    ",
        "                param.data.copy_(fixed_param)\n        print_rank_0(",
    ),
    _exit_one("_load_base_checkpoint", "            print(e)\n            "),
    _exit_one("load_checkpoint", "                ", "    num_floating_point_operations_so_far"),
    _exit_one(
        "load_checkpoint", "'exiting ...'.format(checkpoint_name)\n            )\n            "
    ),
)

CHECKPOINT_EXIT_CHANGE = changes.UpstreamChange(
    name="checkpoint_exit_status",
    subject="checkpointing: exit with status 1 when a checkpoint cannot be loaded",
    motivation="""
        When megatron/training/checkpointing.py cannot load a checkpoint it prints why and calls
        sys.exit() without a status, so the job ends with exit status 0. A launcher, a
        scheduler or a CI harness then takes the failed load for a finished run (and may
        start the next stage on a model that was never loaded). Six calls do this: a
        tracker file that holds neither an iteration nor 'release' (read_metadata), an
        unknown checkpoint version older than 2.0 (fix_query_key_value_ordering, twice), a
        legacy checkpoint file that torch.load cannot read (_load_base_checkpoint), and a
        checkpoint without its iteration or its RNG state (load_checkpoint). main already
        exits with status 1 when --exit-on-missing-checkpoint finds no checkpoint; the
        others still exit with 0.""",
    design="""
        sys.exit() becomes sys.exit(1) at each of these calls, as main does for
        --exit-on-missing-checkpoint. The messages printed before them are unchanged, and so
        is every successful path. Raising an exception instead would change what callers
        that catch SystemExit see; the status alone is what was wrong.""",
    figures="""
        Not a performance change. Without it, each of the six calls raises SystemExit with
        code None (exit status 0); with it, with code 1. The new tests check each call on
        CPU.""",
    test_plan="""
        $ pytest tests/unit_tests/test_checkpointing.py -k "exits_with_status_one"

        Six new tests, one per call (fix_query_key_value_ordering twice), each a CPU test
        without torch.distributed: an unparsable tracker file, checkpoint version 1.5 for a
        query_key_value and a key_value parameter, an unreadable legacy checkpoint file,
        and load_checkpoint on a checkpoint without 'iteration' and one without its RNG
        state. Each fails without the change (the exit status is None) and passes with it.""",
    edits=CHECKPOINT_EXIT_EDITS
    + (
        edits.Replace(
            CHECKPOINT_TESTS,
            "",
            old="    _load_base_checkpoint,\n    get_checkpoint_tracker_filename,\n",
            new="    _load_base_checkpoint,\n    fix_query_key_value_ordering,\n"
            "    get_checkpoint_tracker_filename,\n",
        ),
        edits.InsertAfter(
            CHECKPOINT_TESTS,
            "test_read_metadata_non_distributed",
            text='''

def test_read_metadata_invalid_tracker_exits_with_status_one(tmp_path):
    """A tracker file that holds neither an iteration nor 'release' fails the job."""
    tracker_file = tmp_path / "latest_checkpointed_iteration.txt"
    tracker_file.write_text("not-an-iteration")

    with mock.patch('torch.distributed.is_initialized', return_value=False):
        with pytest.raises(SystemExit) as exc_info:
            read_metadata(str(tracker_file))

    assert exc_info.value.code == 1


@pytest.mark.parametrize("name", ["query_key_value", "key_value"])
def test_fix_query_key_value_ordering_unknown_version_exits_with_status_one(name):
    """A checkpoint version below 2.0 other than 0 and 1.0 fails the job."""
    model = torch.nn.ModuleDict({"attention": torch.nn.ModuleDict({name: torch.nn.Linear(2, 6)})})

    with pytest.raises(SystemExit) as exc_info:
        fix_query_key_value_ordering(model, checkpoint_version=1.5)

    assert exc_info.value.code == 1


def test_load_base_checkpoint_unreadable_legacy_file_exits_with_status_one(tmp_path):
    """A legacy checkpoint file that torch.load cannot read fails the job."""
    args = SimpleNamespace(
        non_persistent_global_ckpt_dir=None,
        non_persistent_ckpt_type=None,
        exit_on_missing_checkpoint=False,
    )
    with open(get_checkpoint_tracker_filename(str(tmp_path)), "w") as f:
        f.write("10")
    rank_dir = tmp_path / "iter_0000010" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(b"not a checkpoint")

    with mock.patch('torch.distributed.is_initialized', return_value=False):
        with pytest.raises(SystemExit) as exc_info:
            _load_base_checkpoint(str(tmp_path), args, rank0=True)

    assert exc_info.value.code == 1


@pytest.mark.parametrize(
    "state_dict", [{"model": {}}, {"iteration": 10, "model": {}}], ids=["iteration", "rng_state"]
)
def test_load_checkpoint_missing_state_exits_with_status_one(state_dict):
    """A checkpoint without its iteration or without its RNG state fails the job."""
    args = SimpleNamespace(
        load="checkpoint",
        ckpt_format="torch",
        auto_detect_ckpt_format=False,
        finetune=False,
        no_load_optim=True,
        no_load_rng=False,
        fp16=False,
        bf16=False,
    )
    set_args(args)

    with mock.patch(
        "megatron.training.checkpointing._load_base_checkpoint",
        return_value=(state_dict, "checkpoint", False, CheckpointType.LEGACY),
    ):
        with pytest.raises(SystemExit) as exc_info:
            load_checkpoint([torch.nn.Module()], None, None)

    assert exc_info.value.code == 1
''',
        ),
    ),
)


CHECKPOINT_EXIT_MESSAGE = (
    "megatron-patchset: megatron-core stopped loading the checkpoint (its message is above); "
    "exit status 1"
)


class _NonZeroExit(types.ModuleType):
    """A stand-in for the ``sys`` module whose ``exit()`` without a status (or with 0) exits
    with status 1; every other attribute is the real module's."""

    def __init__(self, real):
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def exit(self, status=None):
        raise SystemExit(CHECKPOINT_EXIT_MESSAGE if status in (None, 0) else status)


@patch(
    "compat.checkpoint_exit_status",
    "megatron.training.checkpointing.sys",
    reason="megatron-core 0.19.2's checkpoint loader stops on a load error with sys.exit(), exit "
    "status 0, which a launcher or scheduler takes for success",
    upstream_pr="proposed",
    kind="compat",
)
def _checkpoint_exit_status(original):
    return _NonZeroExit(original)
