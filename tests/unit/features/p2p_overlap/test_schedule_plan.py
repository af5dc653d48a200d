"""The fork's fine-grained schedule plan (features/p2p_overlap/schedule_plan.py) on CPU.

The order of operations is recorded with fake layer plans, chunk plans and streams: every node
call, stream switch, event record/wait, pipeline callback and state release goes on a tape,
tagged with the stream that is current. With the default options the tape must equal the one
of megatron-core's own ``TransformerModelChunkSchedulePlan.run`` on the same fakes.
"""

import contextlib
import inspect
import itertools
import types

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.p2p_overlap import flags as p2p_flags
from megatron.patchset.features.p2p_overlap import schedule_plan


class Tape:
    """Events in call order; ``stream`` is the fake stream stack (bottom: computation)."""

    def __init__(self):
        self.events = []
        self.stream = ["comp"]

    def log(self, text, with_stream=True):
        self.events.append(f"{text}@{self.stream[-1]}" if with_stream else text)


class FakeStream:
    def __init__(self, name):
        self.name = name


COMM = FakeStream("comm")


@pytest.fixture
def tape(monkeypatch):
    """Fake CUDA streams for both megatron's plan and the fork's."""
    import megatron.core.models.common.model_chunk_schedule_plan as upstream_plan
    import megatron.core.pipeline_parallel.utils as pp_utils

    t = Tape()

    @contextlib.contextmanager
    def stream(s):
        t.stream.append(s.name)
        t.log(f"enter:{s.name}", with_stream=False)
        try:
            yield
        finally:
            t.stream.pop()
            t.log(f"exit:{s.name}", with_stream=False)

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream(t.stream[-1]))
    monkeypatch.setattr(pp_utils, "get_comm_stream", lambda: COMM)
    monkeypatch.setattr(upstream_plan, "get_comm_stream", lambda: COMM)
    return t


class Node:
    def __init__(self, tape, tag):
        self.tape, self.tag, self.dw_runs = tape, tag, 0
        self.released = False

    def forward(self, x=None):
        self.tape.log(f"{self.tag}.F")
        return x

    def backward(self, grad):
        self.tape.log(f"{self.tag}.B")
        return grad

    def backward_dw(self):
        # megatron's TransformerLayerNode drops its callables after one call and TE's queue
        # raises on an empty pop: every weight gradient runs exactly once, before the release.
        assert self.dw_runs == 0, f"{self.tag}: weight gradient run twice"
        assert not self.released, f"{self.tag}: weight gradient after the layer was released"
        self.dw_runs += 1
        self.tape.log(f"{self.tag}.W")


NODES = (
    ("pre_dispatch_computation", "attn"),
    ("moe_dispatch", "disp"),
    ("mlp", "mlp"),
    ("moe_combine", "comb"),
    ("mtp_post_process", "mtp"),
)


class Layer:
    def __init__(self, tape, side, index, early_release):
        self.tape, self.tag = tape, f"{side}L{index}"
        for attr, short in NODES:
            setattr(self, attr, Node(tape, f"{side}{short}{index}"))
        self.nodes = [getattr(self, attr) for attr, _ in NODES]
        self.config = types.SimpleNamespace(ep_overlap_early_attn_memory_release=early_release)

    def get_low_precision_context(self):
        return contextlib.nullcontext()

    def release_state(self):
        self.tape.log(f"{self.tag}.release", with_stream=False)
        for node in self.nodes:
            node.released = True


class Chunk:
    def __init__(self, tape, side, layers, config, early_release=False, post_process=True):
        self.tape, self.side, self.config, self.vp_stage = tape, side, config, 0
        self.layers = [Layer(tape, side, i, early_release) for i in range(layers)]
        self.all_layers = list(self.layers)
        self.pre_process = Node(tape, f"{side}pre")
        self.post_process = Node(tape, f"{side}post") if post_process else None

    def num_layers(self):
        return len(self.layers)

    def get_layer(self, i):
        return self.layers[i]

    def pop_layer(self):
        return self.layers.pop()

    def record_current_stream(self):
        self.tape.log(f"{self.side}rec")

    def wait_current_stream(self):
        self.tape.log(f"{self.side}wait")

    def release_state(self):
        self.tape.log(f"{self.side}chunk.release", with_stream=False)


def callbacks(tape):
    return dict(
        pre_forward=lambda vp: tape.log("pre_forward"),
        pre_backward=lambda vp: tape.log("pre_backward"),
        post_forward=lambda x, vp: tape.log("post_forward"),
        post_backward=lambda g, vp: tape.log("post_backward"),
    )


def options(comm=False, n=1, tl=False):
    return types.SimpleNamespace(
        overlap_p2p_backward_on_comm_stream=comm,
        overlap_p2p_wgrad_delayed_layer_number=n,
        overlap_p2p_with_transformer_layer_wgrad=tl,
    )


def record(tape, run, f_layers, b_layers, config, *, cbs=True, early=False, post=True):
    """Run ``run`` on fresh fake plans; returns (events, f_plan, b_plan)."""
    tape.events.clear()
    f = Chunk(tape, "f", f_layers, config, early, post) if f_layers is not None else None
    b = Chunk(tape, "b", b_layers, config, early, post) if b_layers is not None else None
    run(f, b, b_grad=1.0 if b is not None else None, **(callbacks(tape) if cbs else {}))
    return list(tape.events), f, b


def upstream_run():
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerModelChunkSchedulePlan,
    )

    return TransformerModelChunkSchedulePlan.run


LAYER_COUNTS = (None, 0, 1, 2, 3)


GRID = [
    (f, b, cbs, early, post)
    for f, b, cbs, early, post in itertools.product(
        LAYER_COUNTS, LAYER_COUNTS, (False, True), (False, True), (False, True)
    )
    if not (f is None and b is None)
]


@pytest.mark.parametrize(
    "config", [types.SimpleNamespace(), options()], ids=["no-options", "explicit-defaults"]
)
def test_default_options_reproduce_upstream_order(tape, config):
    """Every layer-count combination, with and without callbacks, early attention release and
    an output layer: the fork's tape equals megatron-core's, call for call."""
    upstream = upstream_run()
    for f, b, cbs, early, post in GRID:
        want, _, _ = record(tape, upstream, f, b, config, cbs=cbs, early=early, post=post)
        got, _, _ = record(
            tape, schedule_plan.run_chunk, f, b, config, cbs=cbs, early=early, post=post
        )
        assert got == want, (f, b, cbs, early, post)


def test_comm_stream_option_without_backward_p2p_is_upstream(tape):
    """No post_backward callback (no pipeline, VPP warm-up/cool-down, or no P2P overlap): the
    comm-stream option changes nothing, the early attention included."""
    upstream = upstream_run()
    for f, b, _, early, post in GRID:
        want, _, _ = record(tape, upstream, f, b, options(), cbs=False, early=early, post=post)
        got, _, _ = record(
            tape,
            schedule_plan.run_chunk,
            f,
            b,
            options(comm=True),
            cbs=False,
            early=early,
            post=post,
        )
        assert got == want, (f, b, early, post)


def test_layer_run_defaults_match_upstream_layer_run(tape):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan

    for f_on, b_on, early, last in itertools.product((False, True), repeat=4):
        if not (f_on or b_on):
            continue
        traces = []
        for run, kwargs in (
            (TransformerLayerSchedulePlan.run, dict(is_last_layer_in_bwd=last)),
            (schedule_plan.run_layer, dict(defer_pre_dispatch_dw=last)),
        ):
            tape.events.clear()
            f = Layer(tape, "f", 0, early) if f_on else None
            b = Layer(tape, "b", 0, early) if b_on else None
            run(f, b, f_input=1, b_grad=2, **kwargs)
            traces.append(list(tape.events))
        assert traces[0] == traces[1], (f_on, b_on, early, last)


def positions(events, prefix):
    return [i for i, e in enumerate(events) if e.startswith(prefix)]


def one(events, prefix):
    found = positions(events, prefix)
    assert len(found) == 1, (prefix, found, events)
    return found[0]


@pytest.mark.parametrize("comm", [False, True], ids=["comp", "comm"])
@pytest.mark.parametrize("tl", [False, True], ids=["attn-only", "transformer-layer"])
@pytest.mark.parametrize("n", [1, 2, 3, 5], ids=["N1", "N2", "Nall", "Nbeyond"])
def test_weight_gradients_around_post_backward(tape, n, tl, comm):
    layers = 3
    events, f, b = record(
        tape, schedule_plan.run_chunk, layers, layers, options(comm=comm, n=n, tl=tl)
    )
    post_backward = one(events, "post_backward")
    deferred = list(range(min(n, layers)))  # model layers 0 .. N-1 (the last N backward layers)

    # Every weight gradient ran exactly once.
    for layer in b.all_layers:
        assert layer.pre_dispatch_computation.dw_runs == 1 and layer.mlp.dw_runs == 1

    for i in range(layers):
        attn_w, mlp_w = one(events, f"battn{i}.W"), one(events, f"bmlp{i}.W")
        release = one(events, f"bL{i}.release")
        if i in deferred:
            assert attn_w > post_backward, (
                f"layer {i}: attention wgrad should wait for post_backward"
            )
            assert (mlp_w > post_backward) == tl, (
                f"layer {i}: MLP wgrad deferred iff transformer-layer option"
            )
            if tl:
                assert mlp_w == attn_w - 1  # MLP first, then attention, of the same layer
            assert release == attn_w + 1
        else:
            assert attn_w < post_backward and mlp_w < post_backward
            assert release < post_backward
        assert events[attn_w].endswith("@comp") and events[mlp_w].endswith("@comp")

    # Deferred layers flush in backward order: model layer N-1 first, layer 0 last.
    flushed = [one(events, f"battn{i}.W") for i in reversed(deferred)]
    assert flushed == sorted(flushed)
    # ... right after post_backward (and its stream exit), before the output layer's forward.
    assert max(flushed) < one(events, "fpost.F") < one(events, "bpre.B")

    # The stream of post_backward; post_forward is always on the communication stream.
    assert events[post_backward] == ("post_backward@comm" if comm else "post_backward@comp")
    assert events[one(events, "post_forward")] == "post_forward@comm"
    bwait = post_backward - 1
    assert events[bwait] == ("bwait@comm" if comm else "bwait@comp")
    if comm:
        assert events[bwait - 1] == "enter:comm" and events[post_backward + 1] == "exit:comm"

    # The first forward layer's attention: before pre_backward with the option, exactly once.
    attn0 = one(events, "fattn0.F")
    assert (attn0 < one(events, "pre_backward")) == comm
    assert events[attn0].endswith("@comp")


def test_deferral_in_the_backward_only_remainder(tape):
    """More backward than forward layers: deferral counts backward positions, also in the
    backward-only part of the loop."""
    events, _, b = record(tape, schedule_plan.run_chunk, 1, 3, options(n=2, tl=True))
    post_backward = one(events, "post_backward")
    assert one(events, "battn2.W") < post_backward
    for i in (0, 1):
        assert (
            one(events, f"battn{i}.W") > post_backward and one(events, f"bmlp{i}.W") > post_backward
        )
    assert [e for e in events if e.endswith(".W@comp")][-4:] == [
        "bmlp1.W@comp",
        "battn1.W@comp",
        "bmlp0.W@comp",
        "battn0.W@comp",
    ]


def test_early_attention_runs_once_when_the_backward_chunk_has_no_layers(tape):
    """A forward chunk with layers and a backward chunk without (uneven VPP layouts): layer 0's
    attention is issued early and not again in the forward-only loop."""
    events, _, _ = record(tape, schedule_plan.run_chunk, 2, 0, options(comm=True))
    assert len(positions(events, "fattn0.F")) == 1
    assert one(events, "fattn0.F") < one(events, "pre_backward")
    assert positions(events, "fdisp0.F")[0] > one(events, "fattn0.F")


def test_no_early_attention_without_a_backward_plan(tape):
    events, _, _ = record(tape, schedule_plan.run_chunk, 2, None, options(comm=True))
    want, _, _ = record(tape, upstream_run(), 2, None, options())
    assert events == want


def test_early_attention_with_early_memory_release(tape):
    events, _, b = record(
        tape, schedule_plan.run_chunk, 2, 2, options(comm=True, n=2, tl=True), early=True
    )
    assert len(positions(events, "fattn0.F")) == 1
    assert one(events, "battn1.B") < one(events, "fmlp0.F")  # early release kept
    for layer in b.all_layers:
        assert layer.pre_dispatch_computation.dw_runs == 1 and layer.mlp.dw_runs == 1


GOLDEN_N2_TL_COMM = [
    # forward start, with layer 0's attention before the backward receive
    "pre_forward@comp",
    "frec@comp",
    "fpre.F@comp",
    "fattn0.F@comp",
    "brec@comp",
    "pre_backward@comp",
    "brec@comp",
    "bpost.B@comp",
    # f layer 0 with b layer 1 (attention already issued; both wgrads of b layer 1 wait)
    "bmtp1.B@comp",
    "bcomb1.B@comp",
    "bmlp1.B@comp",
    "fdisp0.F@comp",
    "bdisp1.B@comp",
    "fmlp0.F@comp",
    "fcomb0.F@comp",
    "battn1.B@comp",
    "fmtp0.F@comp",
    # f layer 1 with b layer 0 (deferred too)
    "bmtp0.B@comp",
    "bcomb0.B@comp",
    "fattn1.F@comp",
    "bmlp0.B@comp",
    "fdisp1.F@comp",
    "bdisp0.B@comp",
    "fmlp1.F@comp",
    "fcomb1.F@comp",
    "battn0.B@comp",
    "fmtp1.F@comp",
    # both P2Ps on the communication stream
    "enter:comm",
    "fwait@comm",
    "post_forward@comm",
    "exit:comm",
    "enter:comm",
    "bwait@comm",
    "post_backward@comm",
    "exit:comm",
    # deferred weight gradients, backward order, overlapping the P2P
    "bmlp1.W@comp",
    "battn1.W@comp",
    "bL1.release",
    "bmlp0.W@comp",
    "battn0.W@comp",
    "bL0.release",
    "fpost.F@comp",
    "bpre.B@comp",
    "fwait@comp",
    "bwait@comp",
    "bchunk.release",
]


def test_golden_order_n2_transformer_layer_comm_stream(tape):
    """The whole tape for 2+2 layers, N=2, MLP wgrads deferred, backward P2P on comm. (The
    fake nodes log the *current* stream: in a real run moe_dispatch/moe_combine enter their
    own communication stream inside their node.)"""
    events, _, _ = record(tape, schedule_plan.run_chunk, 2, 2, options(comm=True, n=2, tl=True))
    assert events == GOLDEN_N2_TL_COMM


def test_classes_subclass_megatron_and_use_the_fork_runs():
    from megatron.core.models.common.model_chunk_schedule_plan import (
        TransformerLayerSchedulePlan,
        TransformerModelChunkSchedulePlan,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    assert issubclass(schedule_plan.P2POverlapLayerSchedulePlan, TransformerLayerSchedulePlan)
    assert issubclass(schedule_plan.P2POverlapChunkSchedulePlan, TransformerModelChunkSchedulePlan)
    assert issubclass(schedule_plan.P2POverlapGPTModel, GPTModel)
    assert (
        schedule_plan.P2POverlapChunkSchedulePlan.LAYER_SCHEDULE_PLAN_CLASS
        is schedule_plan.P2POverlapLayerSchedulePlan
    )
    assert isinstance(schedule_plan.P2POverlapChunkSchedulePlan.__dict__["run"], staticmethod)
    assert schedule_plan.P2POverlapChunkSchedulePlan.run is schedule_plan.run_chunk
    assert schedule_plan.P2POverlapLayerSchedulePlan.run is schedule_plan.run_layer
    assert (
        schedule_plan.P2POverlapGPTModel.__module__
        == "megatron.patchset.features.p2p_overlap.schedule_plan"
    )
    # megatron's schedule calls build_schedule_plan with upstream's signature.
    ours = inspect.signature(schedule_plan.P2POverlapGPTModel.build_schedule_plan).parameters
    theirs = inspect.signature(GPTModel.build_schedule_plan).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
    with pytest.raises(AttributeError):
        schedule_plan.NoSuchClass  # noqa: B018


@pytest.fixture
def single_process_group():
    from megatron.core import parallel_state

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_build_schedule_plan_returns_the_fork_plan(single_process_group, monkeypatch):
    """A small MoE P2POverlapGPTModel on CPU: its plan is the fork's chunk plan with the fork's
    layer plans and the model's options (the CUDA event is stubbed: no GPU here)."""
    import warnings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            use_cpu_initialization=True,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            moe_token_dispatcher_type="allgather",
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
        p2p_flags.set_p2p_overlap_options(config, overlap_p2p_wgrad_delayed_layer_number=2)
        model = schedule_plan.P2POverlapGPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
            vocab_size=128,
            max_sequence_length=16,
        )
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: object())
    tokens = torch.zeros(1, 8, dtype=torch.long)
    plan = model.build_schedule_plan(
        tokens, torch.arange(8)[None], None, labels=tokens, loss_mask=torch.ones(1, 8)
    )
    assert type(plan) is schedule_plan.P2POverlapChunkSchedulePlan
    assert plan.num_layers() == 3
    assert all(
        type(plan.get_layer(i)) is schedule_plan.P2POverlapLayerSchedulePlan for i in range(3)
    )
    assert plan.config is config
    assert p2p_flags.options_from_config(plan.config).wgrad_delayed_layers == 2
    assert plan.post_process is not None and plan.state.labels is tokens


def test_patch_is_registered_as_a_feature():
    patch = registry.get(schedule_plan.PATCH_NAME)
    assert patch.target == "megatron.training.models.gpt.GPTModel"
    assert patch.kind == "feature"
    assert (
        patch.when
        == p2p_flags.FLAGS
        == (
            "--overlap-p2p-backward-on-comm-stream",
            "--overlap-p2p-wgrad-delayed-layer-number",
            "--overlap-p2p-with-transformer-layer-wgrad",
        )
    )
    assert patch.upstream.number == 4268
    assert not patch.wanted(options()) and not patch.wanted(None)
    assert patch.wanted(options(n=2))


def test_patch_rebinds_the_builders_gptmodel_and_reverts():
    import megatron.training.models.gpt as builder_module
    from megatron.core.models.gpt.gpt_model import GPTModel

    assert builder_module.GPTModel is GPTModel
    names = registry.apply_patches([registry.get(schedule_plan.PATCH_NAME)])
    try:
        assert names == [schedule_plan.PATCH_NAME]
        assert builder_module.GPTModel is schedule_plan.P2POverlapGPTModel
        assert registry.patched_by(builder_module.GPTModel) == schedule_plan.PATCH_NAME
    finally:
        registry.revert(names)
    assert builder_module.GPTModel is GPTModel


def test_the_builder_is_the_only_gptmodel_construction_on_the_training_path():
    """Rebinding megatron.training.models.gpt.GPTModel is enough: GPTModelBuilder.build_model
    looks the name up in its module at call time, and no other module of megatron.training
    constructs a GPTModel."""
    import pathlib
    import re

    import megatron.training
    from megatron.training.models.gpt import GPTModelBuilder

    assert "GPTModel" in GPTModelBuilder.build_model.__code__.co_names
    root = pathlib.Path(megatron.training.__file__).parent
    sites = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for line in path.read_text(errors="replace").splitlines()
        if re.search(r"\bGPTModel\(", line) and not line.lstrip().startswith("#")
    ]
    assert sites == ["models/gpt.py"], sites


def test_gpu_harness_modes():
    """tests/gpu/harness/p2p_overlap.py reads its modes (the GPU test's switch) as documented."""
    from tests.gpu.harness.p2p_overlap import Mode, parse_modes

    assert parse_modes("upstream,upstream,fork:1,fork:2,fork:all:tl:comm") == [
        Mode("upstream", False),
        Mode("upstream#2", False),
        Mode("fork:1", True, "1"),
        Mode("fork:2", True, "2"),
        Mode("fork:all:tl:comm", True, "all", True, True),
    ]
    for bad in ("fork", "fork:x", "fork:2:fast", "upstreams"):
        with pytest.raises(SystemExit):
            parse_modes(bad)
