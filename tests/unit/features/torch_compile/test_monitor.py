"""The compile monitor: warm-up time, then strict mode, then the final report."""

from megatron.patchset.features.torch_compile.monitor import CompileMonitor


def test_monitor_times_warmup_then_turns_strict(monkeypatch):
    import torch

    iteration = {"now": None}
    monitor = CompileMonitor(2, iteration=lambda: iteration["now"])
    printed = []
    monkeypatch.setattr(monitor, "_say", printed.append)
    module = torch.nn.Linear(1, 1)
    monitor.pre_forward(module, ())  # outside training (no iteration yet): nothing
    for it in (0, 0, 1, 1):  # several micro-batches per iteration count once
        iteration["now"] = it
        monitor.pre_forward(module, ())
    assert not monitor.strict and len(printed) == 1 and "first training iteration" in printed[0]
    module.eval()
    iteration["now"] = 2
    monitor.pre_forward(module, ())  # evaluation forwards do not count
    assert not monitor.strict
    module.train()
    monitor.pre_forward(module, ())
    assert monitor.strict and monitor.reports[0]["phase"] == "warmup"
    assert "a recompile of a compiled layer is an error" in printed[-1]
    monitor.final_report()
    assert monitor.reports[-1]["phase"] == "final" and "graphs_since_warmup" in monitor.reports[-1]
