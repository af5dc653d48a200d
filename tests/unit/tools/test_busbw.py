import busbw
import pytest


def test_bus_bandwidth_is_nccl_tests_convention():
    # 1 GB in 10 ms over 4 ranks: algorithm bandwidth 100 GB/s, bus bandwidth 3/4 of it
    assert busbw.bus_bandwidth(1e9, 0.01, 4) == pytest.approx(75.0)
    assert busbw.bus_bandwidth(1e9, 0.01, 2) == pytest.approx(50.0)


def test_sizes_are_checked():
    assert busbw.build_parser().parse_args(["--sizes-mb", "1,64"]).sizes_mb == [1.0, 64.0]
    for bad in ("0", "a,b", ""):
        with pytest.raises(SystemExit):
            busbw.build_parser().parse_args(["--sizes-mb", bad])


def test_it_refuses_to_run_outside_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert busbw.main([]) == 2
    assert "torchrun" in capsys.readouterr().err
