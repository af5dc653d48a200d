import overlap_probe
import pytest


def test_hidden_is_what_starting_together_saved():
    work, alone, gemm, together, serial, hidden = overlap_probe.row("host-copy", 4891, 327, 4945)
    assert (work, serial, hidden) == ("host-copy", 5218, 273)
    # work that waits for the GEMM saves nothing
    assert overlap_probe.row("sm-kernel", 149, 328, 477)[-1] == 0


def test_the_table_has_one_line_per_row():
    table = overlap_probe.format_rows([overlap_probe.row("sm-kernel", 149.2, 328.4, 438.0)])
    lines = table.splitlines()
    assert lines[0].startswith("| work | alone us | GEMM alone us")
    assert lines[2] == "| sm-kernel | 149 | 328 | 438 | 478 | 40 |"


def test_sizes_and_sm_counts_are_checked():
    parse = overlap_probe.build_parser().parse_args
    assert parse(["--green-sms", "112,66"]).green_sms == [112, 66]
    assert parse(["--green-sms", ""]).green_sms == []
    for bad in ("0", "a", "12,-1"):
        with pytest.raises(SystemExit):
            parse(["--green-sms", bad])
    assert parse(["--mb", "16"]).mb == 16.0
    for bad in ("0", "-4", "x", "nan"):
        with pytest.raises(SystemExit):
            parse(["--mb", bad])


def test_it_says_it_needs_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert overlap_probe.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
