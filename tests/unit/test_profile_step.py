"""tools/profile_step.py and the ``training.observe_train_step`` observe patch: the reduction of a
profiler trace to host time per MoE stage, the GPU busy/idle arithmetic, the one-iteration
wrapper, and one profiled step of the tiny local-spec MoE GPT on the CPU."""

import importlib.util
import json
import os
import socket
import types

import pytest
import torch.multiprocessing as mp

from megatron.patchset import patches, profiling
from tests.unit.conftest import ROOT

spec = importlib.util.spec_from_file_location("profile_step", os.path.join(ROOT, "tools", "profile_step.py"))
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


# ---------------------------------------------------------------------------------------
# Interval arithmetic
# ---------------------------------------------------------------------------------------


def test_union_counts_overlaps_once_and_clips_to_the_window():
    assert profiling.union_length([]) == 0
    assert profiling.union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert profiling.union_length([(0, 100), (10, 20), (30, 40)]) == 100  # nested
    assert profiling.union_length([(0, 10), (10, 20)]) == 20  # touching
    assert profiling.union_length([(-5, 5), (8, 12), (50, 60)], lo=0, hi=10) == 7
    assert profiling.union_length([(20, 30)], lo=0, hi=10) == 0


def test_paint_gives_each_instant_to_the_innermost_interval():
    segs = profiling.paint([(0, 100, "outer"), (10, 40, "inner"), (20, 30, "innermost"),
                            (60, 70, "late"), (150, 160, "alone")])
    assert segs == [(0, 10, "outer"), (10, 20, "inner"), (20, 30, "innermost"), (30, 40, "inner"),
                    (40, 60, "outer"), (60, 70, "late"), (70, 100, "outer"), (150, 160, "alone")]
    # Same start: the shorter interval is the inner one.
    assert profiling.paint([(0, 10, "inner"), (0, 50, "outer")]) == [(0, 10, "inner"), (10, 50, "outer")]


# ---------------------------------------------------------------------------------------
# Trace reduction on a synthetic trace
# ---------------------------------------------------------------------------------------


def X(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def ann(name, ts, dur, tid=1):
    return X(name, ts, dur, tid=tid, cat="user_annotation")


def rt(name, ts, dur, corr=None, tid=1):
    return X(name, ts, dur, tid=tid, cat="cuda_runtime", **({} if corr is None else {"correlation": corr}))


def gpu(name, ts, dur, corr=None, cat="kernel"):
    e = X(name, ts, dur, tid=0, cat=cat, **({} if corr is None else {"correlation": corr}))
    e["pid"] = 0
    return e


def synthetic_trace():
    """Main thread 1 runs the forward (labels) and the optimizer; thread 2 runs the backward."""
    return [
        ann("ps:step", 0, 1000),
        ann("ps:attention:1", 10, 100),
        ann("ps:router:1", 120, 50),
        X("aten::topk", 125, 10, **{"Sequence number": 5}),
        X("aten::softmax", 140, 10, **{"Sequence number": 5}),  # the node creator: last to start
        rt("cudaLaunchKernel", 130, 5, corr=1),
        ann("ps:dispatch/preprocess:1", 170, 50),
        ann("ps:permutation/permute:1", 180, 20),
        rt("cudaMemcpyAsync", 204, 1, corr=9),
        rt("cudaStreamSynchronize", 205, 10),
        ann("ps:expert/routed:1", 220, 180),
        X("aten::mm", 230, 20, **{"Sequence number": 7}),
        X("aten::_local_scalar_dense", 260, 5, **{"Sequence number": 8}),
        rt("cudaLaunchKernel", 231, 5, corr=2),
        ann("ps:combine/all-to-all:1", 400, 50),
        X("aten::embedding", 500, 20, **{"Sequence number": 9}),  # outside any label
        # backward on thread 2
        X(profiling.BACKWARD_PREFIX + "SoftmaxBackward0", 600, 50, tid=2, **{"Sequence number": 5}),
        X(profiling.BACKWARD_PREFIX + "MmBackward0", 650, 100, tid=2, **{"Sequence number": 7}),
        rt("cudaLaunchKernel", 660, 5, corr=3, tid=2),
        X(profiling.BACKWARD_PREFIX + "EmbeddingBackward0", 750, 10, tid=2, **{"Sequence number": 9}),
        ann("ps:optimizer:", 900, 80),
        rt("cudaLaunchKernel", 905, 5, corr=4),
        # device
        gpu("router_kernel", 130, 30, corr=1),
        gpu("Memcpy DtoH (Device -> Pinned)", 210, 2, corr=9, cat="gpu_memcpy"),
        gpu("gemm", 230, 70, corr=2),
        gpu("gemm_dgrad", 660, 40, corr=3),
        gpu("adam", 950, 150, corr=4),
        gpu("before_the_step", -50, 20),  # not part of the step
    ]


def test_summary_attributes_host_time_by_category_forward_and_backward():
    s = profiling.summarize_trace(synthetic_trace(), meta={"iteration": 6})
    cats = s["categories"]
    approx = pytest.approx
    assert s["iteration"] == 6 and s["step_host_ms"] == approx(1.0)
    assert cats["attention"]["host_ms"] == approx(0.100)
    # router: 50 us forward + the softmax node's 50 us backward (sequence number 5)
    assert cats["router"]["fwd_host_ms"] == approx(0.050) and cats["router"]["bwd_host_ms"] == approx(0.050)
    # the permute label inside the dispatch preprocess takes its 20 us out of dispatch
    assert cats["dispatch"]["host_ms"] == approx(0.030)
    assert cats["permutation"]["host_ms"] == approx(0.020)
    assert cats["expert"]["fwd_host_ms"] == approx(0.180) and cats["expert"]["bwd_host_ms"] == approx(0.100)
    assert cats["combine"]["host_ms"] == approx(0.050)
    assert cats["optimizer"]["host_ms"] == approx(0.080)
    # the embedding's backward has no labelled forward op: it stays in "other"; all sums to the step
    assert cats["other"]["host_ms"] == approx(1.0 - 0.1 - 0.1 - 0.03 - 0.02 - 0.28 - 0.05 - 0.08)
    assert sum(c["host_ms"] for c in cats.values()) == approx(s["step_host_ms"])
    # launches, syncs and scalar reads land where they were issued (the backward launch on thread 2)
    assert s["kernel_launches"] == 4
    assert [cats[c]["launches"] for c in ("router", "expert", "optimizer")] == [1, 2, 1]
    assert s["d2h_syncs"] == 1 and cats["dispatch"]["syncs"] == 1  # after the permute label ended
    assert cats["dispatch"]["sync_ms"] == approx(0.010) and cats["permutation"]["syncs"] == 0
    assert s["scalar_reads"] == 1 and cats["expert"]["scalar_reads"] == 1
    assert s["d2h_copies"] == 1
    # kernels tied to their launch by correlation id
    assert cats["router"]["gpu_kernel_ms"] == approx(0.030)
    assert cats["expert"]["gpu_kernel_ms"] == approx(0.110)
    assert cats["optimizer"]["gpu_kernel_ms"] == approx(0.150)
    # GPU window: step start to the last GPU activity (1100 us); busy = union of 30+2+70+40+150
    assert s["gpu_window_ms"] == approx(1.100)
    assert s["gpu_busy_ms"] == approx(0.292)
    assert s["gpu_idle_ms"] == approx(1.100 - 0.292)
    # per layer (forward and backward of layer 1)
    assert s["layers"]["1"]["router"] == approx(0.100)
    assert s["layers"]["1"]["expert"] == approx(0.280)
    assert s["details_ms"]["expert/routed (bwd)"] == approx(0.100)


def p2p_trace():
    """Two pipeline calls on the main thread: a backward exchange whose NCCL kernel overlaps a
    compute kernel for 30 of its 100 us, and a forward one fully hidden behind compute."""
    return [
        ann("ps:step", 0, 1000),
        ann("ps:p2p/backward:", 100, 20),
        rt("cuLaunchKernelEx", 105, 5, corr=11),
        ann("ps:p2p/forward:", 300, 20),
        rt("cuLaunchKernelEx", 305, 5, corr=12),
        ann("ps:expert/routed:1", 130, 10),
        rt("cudaLaunchKernel", 131, 2, corr=13),
        rt("cudaLaunchKernel", 340, 2, corr=14),  # untagged compute launch
        rt("cudaLaunchKernel", 350, 2, corr=15),  # an all-to-all outside the P2P calls
        gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 200, 100, corr=11),
        gpu("gemm", 270, 60, corr=13),           # covers 270-300 of the backward P2P
        gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 400, 50, corr=12),
        gpu("elementwise", 390, 80, corr=14),    # covers all of the forward P2P
        gpu("ncclDevKernel_AllToAll", 210, 50, corr=15),  # communication: hides nothing
    ]


def test_pipeline_p2p_kernels_and_their_exposed_time_by_direction():
    s = profiling.summarize_trace(p2p_trace())
    approx = pytest.approx
    assert set(s["p2p"]) == {"backward", "forward"}
    bwd, fwd = s["p2p"]["backward"], s["p2p"]["forward"]
    assert bwd["kernels"] == 1 and bwd["kernel_ms"] == approx(0.100)
    assert bwd["exposed_ms"] == approx(0.070)  # 200-270: only NCCL kernels on the GPU
    assert fwd["kernels"] == 1 and fwd["kernel_ms"] == approx(0.050) and fwd["exposed_ms"] == approx(0.0)
    assert s["categories"]["p2p"]["launches"] == 2
    assert s["categories"]["p2p"]["host_ms"] == approx(0.040)
    assert s["categories"]["p2p"]["gpu_kernel_ms"] == approx(0.150)
    text = profiling.format_summary(s)
    assert "pipeline P2P (backward): 1 kernels, 0.10 ms on the GPU, 0.07 ms exposed" in text
    # a trace without pipeline calls has no P2P entries
    assert profiling.summarize_trace(synthetic_trace())["p2p"] == {}


def test_p2p_kernels_listed_with_the_compute_inside_them_and_split_against_the_peer():
    kernels = profiling.summarize_trace(p2p_trace())["p2p_kernels"]
    assert [(k["dir"], k["ts"], k["end"]) for k in kernels] == [("backward", 200, 300), ("forward", 400, 450)]
    assert kernels[0]["compute"] == [[270, 300]] and kernels[1]["compute"] == [[400, 450]]
    # The peer's matching backward kernel starts at 250: 50 us waiting for it, 50 us transfer of
    # which 270-300 overlaps compute; its forward kernel started first, so no wait there.
    peer = [{"dir": "backward", "ts": 250, "end": 300, "compute": []},
            {"dir": "forward", "ts": 390, "end": 450, "compute": []}]
    split = profiling.split_p2p_wait(kernels, peer)
    approx = pytest.approx
    assert split["backward"] == {"kernels": 1, "peer_wait_ms": approx(0.050), "transfer_ms": approx(0.050),
                                 "transfer_exposed_ms": approx(0.020)}
    assert split["forward"]["peer_wait_ms"] == 0 and split["forward"]["transfer_exposed_ms"] == approx(0.0)
    # a peer kernel starting after this one ended: all wait, no transfer
    late = [dict(peer[0], ts=500, end=600), peer[1]]
    assert profiling.split_p2p_wait(kernels, late)["backward"]["transfer_ms"] == 0
    assert profiling.split_p2p_wait(kernels, peer[:1]) is None  # counts differ: no pairing


def test_pipeline_calls_are_labelled_by_direction():
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    directions = {attr: detail for module, owner, attr, category, detail, _ in profiling._METHOD_LABELS
                  if category == "p2p"}
    assert directions["send_backward_recv_backward"] == "backward"
    assert directions["send_forward_recv_forward"] == "forward"
    assert directions["send_forward_backward_recv_forward_backward"] == "both"
    assert len(directions) == 9 and all(hasattr(P2PCommunicator, name) for name in directions)
    original = P2PCommunicator.send_backward_recv_backward
    labels = profiling.Labels()
    try:
        assert P2PCommunicator.send_backward_recv_backward is not original
        assert P2PCommunicator.send_backward_recv_backward.__wrapped__ is original
    finally:
        labels.remove()
    assert P2PCommunicator.send_backward_recv_backward is original
    assert profiling.rank_folder("/p", 0) == "/p" and profiling.rank_folder("/p", 3) == "/p/rank3"


def test_summary_needs_the_step_label():
    with pytest.raises(ValueError, match="ps:step"):
        profiling.summarize_trace([ann("ps:router:1", 0, 5)])


def test_labels_parse_back():
    assert profiling.parse_label(profiling.label("dispatch", "all-to-all", 3)) == ("dispatch", "all-to-all", 3)
    assert profiling.parse_label(profiling.label("optimizer")) == ("optimizer", "", None)
    assert profiling.parse_label("ps:step") is None and profiling.parse_label("aten::mm") is None


def test_markdown_report_lists_every_category_and_the_step_facts():
    s = profiling.summarize_trace(synthetic_trace(), meta={"iteration": 6, "micro_batch_size": 1})
    text = profile_step.report(s, {"warm_step_ms": 12.5, "profiled_step_ms": 14.0})
    assert "micro_batch_size=1" in text and "12.50 ms" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| router"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["0.10", "10.0%", "0.05", "0.05"] and cells[5] == "1" and cells[8] == "0.03"
    for title in profiling.CATEGORIES.values():
        assert any(line.startswith("| " + title) for line in lines), title
    assert "GPU busy: 0.29 ms, idle: 0.81 ms" in text
    assert "kernel launches: 4" in text and "device-to-host syncs: 1" in text
    assert any(line.startswith("| 1 ") for line in lines)  # per-layer table


def test_profile_request_and_tool_argv(monkeypatch):
    monkeypatch.delenv(profiling.PROFILE_ENV, raising=False)
    assert profiling.profile_request() is None
    monkeypatch.setenv(profiling.PROFILE_ENV, "/tmp/a:b/out:6")
    assert profiling.profile_request() == ("/tmp/a:b/out", 6)
    monkeypatch.setenv(profiling.PROFILE_ENV, "out")
    with pytest.raises(ValueError, match="<dir>:<iteration>"):
        profiling.profile_request()
    argv = profile_step.build_argv(os.path.join(ROOT, "examples", "configs", "tiny_moe.args"),
                                   [("--micro-batch-size", ["2"])], "--moe-permute-fusion --num-layers 2", 6)
    assert argv[argv.index("--micro-batch-size") + 1] == "2"
    assert argv[argv.index("--num-layers") + 1] == "2" and argv.count("--num-layers") == 1
    assert "--moe-permute-fusion" in argv and argv[argv.index("--train-iters") + 1] == "6"


# ---------------------------------------------------------------------------------------
# The patch
# ---------------------------------------------------------------------------------------


def test_patch_is_registered_as_observe_on_train_step(monkeypatch):
    patch = patches.get("training.observe_train_step")
    assert patch.kind == "observe" and patch.target == "megatron.training.training.train_step"
    monkeypatch.delenv(profiling.PROFILE_ENV, raising=False)
    assert not patch.wanted(None)
    monkeypatch.setenv(profiling.PROFILE_ENV, "x:3")
    assert patch.wanted(None)


def test_wrapper_profiles_exactly_the_requested_iteration_with_labels_from_the_start(tmp_path, monkeypatch):
    import torch
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    monkeypatch.setenv(profiling.PROFILE_ENV, f"{tmp_path}:2")
    route, permute = moe_layer.MoELayer.route, token_dispatcher.permute
    seen = []

    class Opt:
        def step(self):
            seen.append(("step",))
            return torch.ones(4).sum()

    def finalize(*a):
        return "final"

    def fake_train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config,
                        forward_backward_func, iteration=None, pg_collection=None):
        labelled = moe_layer.MoELayer.route is not route
        seen.append((iteration, labelled, token_dispatcher.permute is not permute, profiling._RECORDING[0]))
        optimizer.step()
        config.finalize_model_grads_func()
        return f"result {iteration}"

    opt, config = Opt(), types.SimpleNamespace(finalize_model_grads_func=finalize)
    wrapped = patches.get("training.observe_train_step").factory(fake_train_step)
    try:
        results = [wrapped(None, None, None, opt, None, config, None, iteration=i) for i in range(3)]
    finally:
        profiling.remove_labels()
    assert results == ["result 0", "result 1", "result 2"]
    its = [s for s in seen if s[0] != "step"]
    # Labels installed from the first iteration on (compiled layers must never see methods
    # change), recording only in the profiled one (iteration 2 = iteration=1).
    assert its == [(0, True, True, False), (1, True, True, True), (2, True, True, False)]
    assert moe_layer.MoELayer.route is route and token_dispatcher.permute is permute
    assert "step" not in vars(opt) and config.finalize_model_grads_func is finalize
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["iteration"] == 2
    assert summary["categories"]["optimizer"]["host_ms"] > 0
    assert summary["categories"]["grad_sync"]["host_ms"] > 0
    assert (tmp_path / "trace.json").exists()


# ---------------------------------------------------------------------------------------
# End to end: one profiled step of the tiny MoE on the CPU
# ---------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def profiled_worker(rank, argv, port, folder, steps):
    """pretrain_gpt.py's model, data, forward_step and loss on the CPU, with a train step of
    megatron's signature wrapped by the patch (megatron's own train_step needs a GPU)."""
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **{profiling.PROFILE_ENV: f"{folder}:{steps}"})
    import sys

    import pytest as _pytest
    import torch

    from tests.unit import cpu_shims

    cpu_shims.install(_pytest.MonkeyPatch())
    sys.argv = ["pretrain_gpt.py", *argv]
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_layer
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.ps_args.add_patchset_args)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_config = pretrain_gpt.model_config_from_args(args)
    model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([16, 0, 0])
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    route = moe_layer.MoELayer.route

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None):
        output, loss_fn = forward_step_func(data_iterator, model)
        loss, num_tokens, _ = loss_fn(output)
        (loss / num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss / num_tokens)

    step = patches.get("training.observe_train_step").factory(train_step)
    for i in range(steps):
        step(pretrain_gpt.forward_step, iter([batch]), model, optimizer, None, model.config, None, iteration=i)
    installed = moe_layer.MoELayer.route is not route
    profiling.remove_labels()
    with open(os.path.join(folder, "after.json"), "w") as handle:
        json.dump({"installed_for_the_run": installed, "route_restored": moe_layer.MoELayer.route is route}, handle)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_one_profiled_step_of_the_tiny_moe_on_cpu(tmp_path):
    from tests.unit.test_pretrain_gpt_cpu import cpu_argv

    argv = cpu_argv("--global-batch-size", "2", "--micro-batch-size", "1")
    mp.spawn(profiled_worker, args=(argv, _free_port(), str(tmp_path), 2), nprocs=1, join=True)
    summary = json.load(open(tmp_path / "summary.json"))
    after = json.load(open(tmp_path / "after.json"))
    assert after["installed_for_the_run"] and after["route_restored"]
    assert summary["iteration"] == 2 and (tmp_path / "trace.json").stat().st_size > 0
    cats = summary["categories"]
    for name in ("attention", "router", "dispatch", "permutation", "expert", "combine", "optimizer"):
        assert cats[name]["host_ms"] > 0, name
    # backward nodes found their forward stage through the sequence numbers
    for name in ("attention", "router", "expert"):
        assert cats[name]["bwd_host_ms"] > 0, name
    assert sum(c["host_ms"] for c in cats.values()) == pytest.approx(summary["step_host_ms"], rel=1e-6)
    assert summary["gpu_events"] == 0 and summary["kernel_launches"] == 0
    # four MoE layers, each with its own router and experts
    assert sorted(summary["layers"], key=int) == ["1", "2", "3", "4"]
    assert all(v["router"] > 0 and v["expert"] > 0 for v in summary["layers"].values())
    text = profiling.format_summary(summary)
    assert "token dispatch" in text and "no CUDA activity" in text


def test_top_kernels_sum_the_step_kernels_by_name():
    s = profiling.summarize_trace(synthetic_trace())
    top = s["top_kernels"]
    assert top and top == sorted(top, key=lambda k: -k["gpu_ms"])
    assert sum(k["calls"] for k in top) == sum(
        1 for e in synthetic_trace() if e.get("cat") == "kernel" and e.get("ph") == "X" and e["ts"] + e["dur"] > 0)
    text = profiling.format_summary(s)
    assert "GPU kernels of the step:" in text and top[0]["name"][:20] in text


def test_labels_record_only_while_profiling_and_are_transparent_to_dynamo(monkeypatch):
    """Installed from the first iteration, the labels change nothing a compiled function guards
    on: compiling through one and then recording with it is not a recompile."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    recorded = []

    class Recorder:
        def __init__(self, name):
            recorded.append(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def work(x):
        return x * 2 + 1

    labelled = profiling._labelled(work, "router", "", sets_layer=False)
    region = profiling._labelled(torch.compiler.disable(work), "dispatch", "", sets_layer=False)
    monkeypatch.setattr(torch.profiler, "record_function", Recorder)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda t: region(labelled(t)) - 1, backend="eager")
    x = torch.ones(3)
    try:
        assert torch.equal(compiled(x), torch.full((3,), 6.0))
        assert recorded == []  # not recording
        profiling._RECORDING[0] = True
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(compiled(x), torch.full((3,), 6.0))
        # The compiled part carries no label; the compile-disabled region runs eagerly, labelled.
        assert recorded == [profiling.label("dispatch", "", None)]
        assert labelled(x).tolist() == [3.0] * 3 and recorded[-1] == profiling.label("router", "", None)
    finally:
        profiling._RECORDING[0] = False
        torch._dynamo.reset()
