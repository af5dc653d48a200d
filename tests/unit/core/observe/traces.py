"""Synthetic chrome traces of one profiled step, for the trace-summary and profile_step tests."""

from megatron.patchset.core.observe import trace_summary


def X(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 7,
        "tid": tid,
        "args": args,
    }


def ann(name, ts, dur, tid=1):
    return X(name, ts, dur, tid=tid, cat="user_annotation")


def rt(name, ts, dur, corr=None, tid=1):
    return X(
        name,
        ts,
        dur,
        tid=tid,
        cat="cuda_runtime",
        **({} if corr is None else {"correlation": corr}),
    )


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
        X(
            trace_summary.BACKWARD_PREFIX + "SoftmaxBackward0",
            600,
            50,
            tid=2,
            **{"Sequence number": 5},
        ),
        X(trace_summary.BACKWARD_PREFIX + "MmBackward0", 650, 100, tid=2, **{"Sequence number": 7}),
        rt("cudaLaunchKernel", 660, 5, corr=3, tid=2),
        X(
            trace_summary.BACKWARD_PREFIX + "EmbeddingBackward0",
            750,
            10,
            tid=2,
            **{"Sequence number": 9},
        ),
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
        gpu("gemm", 270, 60, corr=13),  # covers 270-300 of the backward P2P
        gpu("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 400, 50, corr=12),
        gpu("elementwise", 390, 80, corr=14),  # covers all of the forward P2P
        gpu("ncclDevKernel_AllToAll", 210, 50, corr=15),  # communication: hides nothing
    ]
