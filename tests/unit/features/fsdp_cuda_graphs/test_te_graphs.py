"""Per-layer CUDA graphs with Megatron-FSDP on the CPU: hooks taken off for TE's capture, handed to
TE as capture_time_hooks and restored; the capture helper subclass; the patches on
GraphableMegatronModule (hooks fire around capture and replay, params_dtype capture inputs)."""

import functools
import types

import pytest
import torch

from megatron.patchset.core import registry
from megatron.patchset.features.fsdp_cuda_graphs import fsdp_hooks, te_graphs
from tests.unit.features.fsdp_cuda_graphs.fakes import unit_and_log


def fake_make_graphed_callables(
    callables, sample_args, *, capture_time_hooks=None, log=None, warmup=2, capturing=None
):
    """TE 2.20.2's make_graphed_callables contract, without graphs: refuses callables with
    hooks, checks the capture_time_hooks keys, runs ``hook(module)`` (None required) around a
    warm-up forward and backward of each callable, as TE does outside the captured graphs."""
    for c in callables:
        if any(len(getattr(c, d)) for d in te_graphs.MODULE_HOOK_DICTS.values()):
            raise RuntimeError(
                "Modules must not have hooks registered at the time they are passed."
            )
    hooks = capture_time_hooks or [None] * len(callables)
    assert len(hooks) == len(callables)
    for entry in hooks:
        assert entry is None or set(entry) <= set(te_graphs.TE_HOOK_KEYS), entry

    def run(idx, key, module):
        for hook in ((hooks[idx] or {}).get(key) or {}).values():
            if hook(module) is not None:
                raise RuntimeError("capture_time_hooks must not return a value.")

    for _ in range(warmup):
        for idx, (module, args) in enumerate(zip(callables, sample_args)):
            run(idx, "forward_pre_hooks", module)
            out = module(*args)
            log.append("fwd")
            run(idx, "forward_hooks", module)
            run(idx, "backward_pre_hooks", module)
            out.sum().backward()
            log.append("bwd")
            run(idx, "backward_hooks", module)
    return [lambda *a: None for _ in callables]


def hook_ids(module):
    return {kind: list(getattr(module, d)) for kind, d in te_graphs.MODULE_HOOK_DICTS.items()}


def test_take_off_reroute_restore_twice():
    unit, _, registrar, log = unit_and_log()
    capturing = [False]
    fsdp_hooks.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0])
    before = hook_ids(unit)
    tables = {d: id(getattr(unit, d)) for d in te_graphs.MODULE_HOOK_DICTS.values()}
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        stash = te_graphs.take_off_hooks(unit)
        assert all(not getattr(unit, d) for d in te_graphs.MODULE_HOOK_DICTS.values())
        te = te_graphs.capture_time_hooks(stash, "layer 1")
        assert set(te) == set(te_graphs.TE_HOOK_KEYS)
        # One handler per key; the wrappers themselves are not among the values.
        assert {k: len(v) for k, v in te.items()} == dict.fromkeys(te_graphs.TE_HOOK_KEYS, 1)
        given = [fn.__wrapped__ for table in te.values() for fn in table.values()]
        assert not any(isinstance(fn, functools.partial) for fn in given)
        assert "create_custom_backward_hook.<locals>.forward_hook" not in [
            fsdp_hooks.local_name(fn) for fn in given
        ]
        assert (
            fsdp_hooks.local_name(next(iter(te["backward_pre_hooks"].values())).__wrapped__)
            == "_pre_backward_param_unshard"
        )
        assert (
            fsdp_hooks.local_name(next(iter(te["backward_hooks"].values())).__wrapped__)
            == "_post_backward_release_module"
        )
        log.clear()
        capturing[0] = True
        fake_make_graphed_callables([unit], [(x,)], capture_time_hooks=[te], log=log, warmup=1)
        capturing[0] = False
        # Exactly the eager sequence, each handler once (wrappers withheld, inner handlers
        # rerouted), and no gradient processing during capture.
        assert log == [
            "unshard",
            "fwd",
            "reshard",
            "pre_backward_unshard",
            "bwd",
            "post_backward_release",
        ]
        te_graphs.restore_hooks(stash)
        te_graphs.restore_hooks(stash)  # idempotent
        assert hook_ids(unit) == before
        assert {d: id(getattr(unit, d)) for d in te_graphs.MODULE_HOOK_DICTS.values()} == tables
    # Restored hooks work eagerly again, in megatron's order.
    log.clear()
    unit(x).sum().backward()
    assert log[:3] == ["unshard", "reshard", "pre_backward_unshard"]
    assert sorted(log[3:]) == ["post_backward_release", "process_grads", "process_grads"]


def test_te_refuses_the_module_with_hooks_on():
    """What the patch fixes: TE 2.20.2 refuses a callable that still has FSDP's hooks."""
    unit, _, _, log = unit_and_log()
    with pytest.raises(RuntimeError, match="must not have hooks"):
        fake_make_graphed_callables([unit], [(torch.randn(2, 4),)], log=log)


def test_restore_keeps_hooks_added_meanwhile_and_handles_stay_valid():
    unit = torch.nn.Linear(4, 4)
    calls = []
    handle = unit.register_forward_hook(lambda m, i, o: calls.append("a"))
    stash = te_graphs.take_off_hooks(unit)
    unit.register_forward_hook(lambda m, i, o: calls.append("b"))
    te_graphs.restore_hooks(stash)
    unit(torch.randn(1, 4))
    assert calls == ["a", "b"]
    handle.remove()
    unit(torch.randn(1, 4))
    assert calls == ["a", "b", "b"]


def test_unknown_hook_is_refused_with_its_name():
    unit = torch.nn.Linear(4, 4)

    def my_logging_hook(module, args, output):
        return None

    unit.register_forward_hook(my_logging_hook)
    stash = te_graphs.take_off_hooks(unit)
    with pytest.raises(te_graphs.CudaGraphHookError, match="my_logging_hook.*layer 3"):
        te_graphs.capture_time_hooks(stash, "layer 3")
    te_graphs.restore_hooks(stash)
    assert len(unit._forward_hooks) == 1
    assert te_graphs.capture_time_hooks(te_graphs.take_off_hooks(torch.nn.Linear(2, 2))) is None


def test_root_wrapper_is_withheld_and_fsdp_hooks_inside_a_layer_are_refused():
    unit, root, _, _ = unit_and_log(with_root=True)
    stash = te_graphs.take_off_hooks(root)
    te = te_graphs.capture_time_hooks(stash, "root")
    assert te is None  # the only hook on the root is the withheld root pre-backward wrapper
    te_graphs.restore_hooks(stash)
    with pytest.raises(te_graphs.CudaGraphHookError, match="inside a layer"):
        te_graphs.check_no_hooks_inside(root, "layer 1")
    te_graphs.check_no_hooks_inside(unit, "layer 1")


class FakeHelper:
    """The parts of megatron's TECudaGraphHelper the fork's subclass builds on."""

    def __init__(self, layers, log, fail=False):
        self.flattened_callables = layers
        self.model, self.config, self.log, self.fail = [], types.SimpleNamespace(), log, fail
        self.deleted = False

    def _get_cuda_graph_input_data(self):
        return [(torch.randn(2, 4, requires_grad=True),) for _ in self.flattened_callables], {
            "allow_unused_input": True
        }

    def create_cudagraphs(self):
        from megatron.core.transformer import cuda_graphs as mcore_graphs

        mcore_graphs._set_capture_start()  # megatron's _start_capturing
        sample_args, kwargs = self._get_cuda_graph_input_data()
        if self.fail:
            raise RuntimeError("capture failed")  # megatron leaves its capture flag set
        fake_make_graphed_callables(
            self.flattened_callables,
            sample_args,
            capture_time_hooks=kwargs.get("capture_time_hooks"),
            log=self.log,
            warmup=1,
        )
        mcore_graphs._set_capture_end()  # megatron's _finish_capturing

    def delete_cuda_graphs(self):
        self.deleted = True


@pytest.fixture
def helper_class(monkeypatch):
    raw = []
    monkeypatch.setattr(fsdp_hooks, "raw_parameters", _recording_raw_parameters(raw))
    return te_graphs._helper_class(FakeHelper), raw


def _recording_raw_parameters(calls):
    import contextlib

    @contextlib.contextmanager
    def raw_parameters(model):
        calls.append("raw")
        try:
            yield []
        finally:
            calls.append("restored")

    return raw_parameters


@pytest.mark.parametrize("fail", [False, True])
def test_helper_reroutes_for_capture_and_restores(helper_class, fail):
    cls, raw = helper_class
    units, logs = [], []
    for _ in range(2):
        unit, _, registrar, log = unit_and_log()
        fsdp_hooks.guard_gradient_hooks(
            registrar.grad_acc_hooks.values()
        )  # megatron-core's capture flag
        units.append(unit)
        logs.append(log)
    before = [hook_ids(u) for u in units]
    shared_log = []
    helper = cls(units, shared_log, fail=fail)
    if fail:
        with pytest.raises(RuntimeError, match="capture failed"):
            helper.create_cudagraphs()
    else:
        helper.create_cudagraphs()
        assert shared_log == ["fwd", "bwd", "fwd", "bwd"]
        for log in logs:
            assert log == ["unshard", "reshard", "pre_backward_unshard", "post_backward_release"]
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    assert not is_graph_capturing()
    assert raw == ["raw", "restored"]
    assert [hook_ids(u) for u in units] == before  # restored, also after a failed capture
    assert helper._patchset_capture_time_hooks is None
    helper.delete_cuda_graphs()
    assert helper.deleted and [hook_ids(u) for u in units] == before


def test_helper_without_fsdp_hooks_passes_no_capture_time_hooks(helper_class):
    cls, _ = helper_class
    helper = cls([torch.nn.Linear(4, 4)], [])
    seen = {}
    helper._patchset_capture_time_hooks = [None]
    _, kwargs = helper._get_cuda_graph_input_data()
    seen.update(kwargs)
    assert "capture_time_hooks" not in seen


MODULE_PATCHES = (
    "fsdp_cuda_graphs.hooks_fire_on_graphed_call",
    "fsdp_cuda_graphs.capture_uses_original_forward",
    "fsdp_cuda_graphs.static_inputs_params_dtype",
)


@pytest.fixture
def module_patches():
    names = registry.apply_patches([registry.get(n) for n in MODULE_PATCHES])
    yield
    registry.revert(names)


def graphable(params_dtype=torch.float32):
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=1,
        cuda_graph_impl="transformer_engine",
        params_dtype=params_dtype,
    )

    class Layer(GraphableMegatronModule):
        def __init__(self):
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)
            self.calls = []

        def forward(self, x):
            self.calls.append("forward")
            return self.linear(x)

    return Layer()


def test_patch_targets_and_flags():
    for name in MODULE_PATCHES + ("fsdp_cuda_graphs.capture_helper", fsdp_hooks.PATCH_NAME):
        patch = registry.get(name)
        assert patch.kind == "feature" and patch.upstream.number == 4232 and patch.reason
    args = types.SimpleNamespace(use_megatron_fsdp=True, cuda_graph_impl="transformer_engine")
    eager = types.SimpleNamespace(use_megatron_fsdp=True, cuda_graph_impl="none")
    ddp_graphs = types.SimpleNamespace(
        use_megatron_fsdp=False, cuda_graph_impl="transformer_engine", bf16=False
    )
    bf16_graphs = types.SimpleNamespace(
        use_megatron_fsdp=False, cuda_graph_impl="transformer_engine", bf16=True
    )
    assert registry.get("fsdp_cuda_graphs.capture_helper").wanted(args)
    assert not registry.get("fsdp_cuda_graphs.capture_helper").wanted(eager)
    assert not registry.get("fsdp_cuda_graphs.capture_helper").wanted(ddp_graphs)
    assert registry.get("fsdp_cuda_graphs.static_inputs_params_dtype").wanted(ddp_graphs)
    # a bf16 model gets upstream's bf16 capture inputs already: no patch, so upstream mode can graph
    # it
    assert not registry.get("fsdp_cuda_graphs.static_inputs_params_dtype").wanted(bf16_graphs)


def test_hooks_fire_around_capture_and_replay(module_patches):
    from megatron.core.transformer import cuda_graphs as mcore_graphs

    layer = graphable()
    events = []
    layer.register_forward_pre_hook(lambda m, a: events.append("pre"))
    layer.register_forward_hook(lambda m, a, o: events.append("post"))
    x = torch.randn(2, 4)
    mcore_graphs._set_capture_start()
    try:
        layer(x)  # capture path: the base capture runs the real forward (no recursion)
    finally:
        mcore_graphs._set_capture_end()
    assert events == ["pre", "post"] and layer.calls == ["forward"]
    layer.cuda_graphs = [lambda *a, **k: (events.append("graph"), (a[0],))[1]]
    layer.current_microbatch = 0
    layer(x)  # replay path
    assert events == ["pre", "post", "pre", "graph", "post"]
    assert "forward" not in vars(layer) and te_graphs.ORIGINAL_FORWARD not in vars(layer)
    layer.eval()
    layer(x)  # not training: upstream's eager path
    assert layer.calls == ["forward", "forward"]


def test_without_the_patch_hooks_do_not_fire_on_replay():
    layer = graphable()
    events = []
    layer.register_forward_pre_hook(lambda m, a: events.append("pre"))
    layer.cuda_graphs = [lambda *a, **k: (events.append("graph"), (a[0],))[1]]
    layer(torch.randn(2, 4))
    assert events == ["graph"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_static_inputs_use_params_dtype(module_patches, monkeypatch, dtype):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    inputs = graphable(dtype).get_layer_static_inputs(seq_length=8, micro_batch_size=2)
    hidden = inputs["hidden_states"]
    assert hidden.dtype == dtype and hidden.shape == (8, 2, 4) and hidden.requires_grad
