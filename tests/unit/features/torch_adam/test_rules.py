"""The rule of --adam-impl torch: what it needs, named with the fix."""

import pytest

from tests.unit.conftest import failures, tiny_argv

TORCH = ("--adam-impl", "torch")
RULE = "adam-impl-torch-requirements"


def test_the_plain_and_the_distributed_optimizer_and_the_optimizer_graph_pass():
    assert failures(tiny_argv(*TORCH)) == {}
    assert failures(tiny_argv(*TORCH, "--optimizer-cuda-graph")) == {}
    for impl in ("torch", "triton"):
        distributed = ("--use-distributed-optimizer", "--optimizer-cuda-graph")
        assert failures(tiny_argv("--adam-impl", impl, *distributed), world_size=2) == {}


@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--optimizer", "sgd"), "--optimizer adam (got sgd)"),
        (
            ("--use-distributed-optimizer", "--use-precision-aware-optimizer"),
            "no --use-precision-aware-optimizer",
        ),
        (
            (
                "--optimizer-cuda-graph",
                "--weight-decay-incr-style",
                "linear",
                "--start-weight-decay",
                "0.0",
                "--end-weight-decay",
                "0.1",
            ),
            "--weight-decay-incr-style constant with --optimizer-cuda-graph",
        ),
    ],
)
def test_what_torch_adam_does_not_cover_is_named(extra, expected):
    got = failures(tiny_argv(*TORCH, *extra))
    assert expected in got.get(RULE, ""), got
    assert RULE not in failures(tiny_argv(*extra))


def test_an_unknown_implementation_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        failures(tiny_argv("--adam-impl", "apex"))
    assert "invalid choice: 'apex'" in capsys.readouterr().err
