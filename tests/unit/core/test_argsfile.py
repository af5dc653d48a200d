"""Flag files (``examples/configs/*.args``): reading, overriding and removing flags; every example
config parses with megatron's parser."""

import os

from megatron.patchset.core import argsfile
from tests.unit.conftest import ROOT, parse


def test_argsfile_read_override_remove(tmp_path):
    path = tmp_path / "c.args"
    path.write_text("# comment\n--a 1 --flag\n--b 2  # trailing\n")
    argv = argsfile.read(str(path))
    assert argv == ["--a", "1", "--flag", "--b", "2"]
    assert argsfile.override(argv, "--a", "3") == ["--flag", "--b", "2", "--a", "3"]
    assert argsfile.remove(argv, "--flag") == ["--a", "1", "--b", "2"]
    assert argsfile.remove(argv, "--b") == ["--a", "1", "--flag"]


def test_example_configs_parse_with_megatron():
    for name in ("tiny_moe.args", "reference_moe.args"):
        args = parse(argsfile.read(os.path.join(ROOT, "examples", "configs", name)))
        assert args.num_experts and args.mock_data
