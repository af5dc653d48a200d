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
    assert parse([]).sm_carveout == [16, 20, 24, 32]
    assert parse(["--sm-carveout", "20,32"]).sm_carveout == [20, 32]
    assert parse(["--sm-carveout", ""]).sm_carveout == []
    with pytest.raises(SystemExit):
        parse(["--sm-carveout", "0"])
    assert parse(["--mb", "16"]).mb == 16.0
    for bad in ("0", "-4", "x", "nan"):
        with pytest.raises(SystemExit):
            parse(["--mb", bad])


def test_it_says_it_needs_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert overlap_probe.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_carveout_of_every_sm_is_refused_before_timing(monkeypatch):
    import torch

    probe = object.__new__(overlap_probe.Probe)  # no GPU tensors: it stops before timing
    probe.torch, probe.carveout = torch, None
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(probe, "pair", lambda *a: pytest.fail("timed a refused carve-out"))
    with pytest.raises(
        SystemExit, match="--sm-carveout 132 leaves the GEMM no SM: this GPU has 132"
    ):
        probe.carved("sm-kernel", None, [20, 132])
    assert probe.carveout is None


def test_carved_rows_set_the_carveout_for_their_pair_only(monkeypatch):
    import torch

    probe = object.__new__(overlap_probe.Probe)
    probe.torch, probe.carveout = torch, None
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    seen = []
    monkeypatch.setattr(probe, "pair", lambda work, part: seen.append((work, probe.carveout)))
    probe.carved("nccl-all-to-all", None, [16, 24])
    assert seen == [
        ("nccl-all-to-all, GEMM leaving 16 SMs", 16),
        ("nccl-all-to-all, GEMM leaving 24 SMs", 24),
    ]
    assert probe.carveout is None
