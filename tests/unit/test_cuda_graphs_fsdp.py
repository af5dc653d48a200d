"""Megatron-FSDP + TransformerEngine per-layer CUDA graphs, on the CPU.

* The rules (flag combinations) as pretrain_gpt.py runs them.
* The hook bookkeeping on plain ``torch.nn`` modules: a stand-in for Megatron-FSDP registers
  hooks the way megatron-core 0.19.2 does (its local functions carry the same qualified names,
  so the fork's markers recognise them), and a stand-in for TE 2.20.2's ``make_graphed_callables``
  enforces its contract (no hooks on the callables, only the four ``capture_time_hooks`` keys,
  ``hook(module)`` returning None) and runs the hooks around a warm-up forward and backward.
* Drift: the real ``MegatronFSDP._register_fsdp_hooks`` still defines the functions the markers
  rely on.
"""

import functools
import types

import pytest
import torch

from megatron.patchset import cuda_graphs as cg
from megatron.patchset import megatron_fsdp as mf
from megatron.patchset import patches
from tests.unit.test_rules import combination_failures, tiny_argv

# ---------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------

FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--ckpt-format", "fsdp_dtensor")
GRAPHS = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router",
          "moe_preprocess")
DOUBLE_BUFFER = ("--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail")


@pytest.fixture(autouse=True)
def _fsdp_allows_connections(monkeypatch):
    # megatron's validate_args refuses Megatron-FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1.
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def fsdp_graphs_argv(*extra, double_buffer=DOUBLE_BUFFER, graphs=GRAPHS):
    return tiny_argv(*FSDP, *graphs, *double_buffer, *extra)


@pytest.mark.parametrize("world_size, extra", [(1, ()), (2, ()), (2, ("--expert-model-parallel-size", "2"))])
def test_fsdp_cuda_graphs_layouts_are_valid(world_size, extra):
    assert combination_failures(fsdp_graphs_argv(*extra), world_size) == {}
    # Eager Megatron-FSDP needs none of it.
    assert combination_failures(tiny_argv(*FSDP, *extra), world_size) == {}


@pytest.mark.parametrize("drop, named", [
    ("--fsdp-double-buffer", "address"),
    ("--fsdp-db-use-persist-buf-on-alloc-fail", "dynamic buffer during replay"),
])
def test_fsdp_cuda_graphs_double_buffer(drop, named):
    argv = fsdp_graphs_argv(double_buffer=tuple(f for f in DOUBLE_BUFFER if f != drop))
    got = combination_failures(argv, 2)
    assert set(got) == {"fsdp-cuda-graphs-double-buffer"}
    message = got["fsdp-cuda-graphs-double-buffer"]
    assert drop in message and named in message and "illegal memory access" in message


def test_fsdp_cuda_graphs_double_buffer_other_strategy_and_any_scope():
    argv = fsdp_graphs_argv("--data-parallel-sharding-strategy", "optim_grads", double_buffer=(),
                            graphs=("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe_router"))
    message = combination_failures(argv, 2)["fsdp-cuda-graphs-double-buffer"]
    for flag in ("optim_grads_params", "--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"):
        assert flag in message


def test_fsdp_cuda_graphs_double_buffer_forced_by_nccl_ub_counts():
    """megatron's validate_args turns the double buffer on for the max-pool allocator (and
    --use-nccl-ub); the rule sees it."""
    argv = fsdp_graphs_argv("--fsdp-db-use-persist-buf-on-alloc-fail", "--megatron-fsdp-max-pool-double-buffer",
                            double_buffer=())
    assert "fsdp-cuda-graphs-double-buffer" not in combination_failures(argv, 2)


@pytest.mark.parametrize("extra, named", [
    (("--gradient-accumulation-fusion",), "--no-gradient-accumulation-fusion"),
    (("--megatron-fsdp-enable-fine-grained-param-gather",), "fine-grained-param-gather"),
    (("--pipeline-model-parallel-size", "2", "--global-batch-size", "16"), "--pipeline-model-parallel-size 2"),
    (("--cuda-graph-warmup-steps", "0"), "--cuda-graph-warmup-steps 0"),
])
def test_fsdp_cuda_graphs_supported(extra, named):
    argv = fsdp_graphs_argv(*extra)
    if "--gradient-accumulation-fusion" in extra:
        argv.remove("--no-gradient-accumulation-fusion")
        argv.remove("--gradient-accumulation-fusion")
    got = combination_failures(argv, 2)
    assert "fsdp-cuda-graphs-supported" in got, got
    assert named in got["fsdp-cuda-graphs-supported"]


def test_fsdp_cuda_graphs_supported_refuses_local_graphs():
    argv = tiny_argv(*FSDP, "--cuda-graph-impl", "local")
    message = combination_failures(argv, 1)["fsdp-cuda-graphs-supported"]
    assert "--cuda-graph-impl local" in message and "transformer_engine" in message


# ---------------------------------------------------------------------------------------
# A stand-in for Megatron-FSDP's hook registration
# ---------------------------------------------------------------------------------------


class _Release(torch.autograd.Function):
    """Identity whose backward calls a handler (FSDP's RegisterFSDPBackwardFunction)."""

    @staticmethod
    def forward(ctx, handler, x):
        ctx.handler = handler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.handler()
        return None, grad


class MegatronFSDP:
    """Registers on a unit module the four hooks megatron-core 0.19.2 registers on an FSDP
    unit, plus a root pre-backward wrapper and gradient hooks; every handler appends to
    ``log``. (Named like the real class: the hooks' qualified names are what the fork's markers
    recognise.)"""

    def __init__(self, log):
        self.log = log
        self.grad_acc_hooks = {}

    def _register_fsdp_hooks(self, unit, root=None):
        log = self.log

        @torch.compiler.disable
        def _pre_forward_param_unshard(module, *unused):
            log.append("unshard")

        def _post_backward_release_module(module, *unused):
            log.append("post_backward_release")

        @torch.compiler.disable
        def _register_post_backward_hook(post_backward_hook, module, args, kwargs):
            if not torch.is_grad_enabled():
                return args, kwargs
            args = tuple(_Release.apply(functools.partial(post_backward_hook, module), a)
                         if torch.is_tensor(a) and a.requires_grad else a for a in args)
            return args, kwargs

        @torch.compiler.disable
        def _post_forward(module, input, output):
            log.append("reshard")
            return output

        @torch.compiler.disable
        def _pre_backward_param_unshard(module, *unused):
            log.append("pre_backward_unshard")

        def _root_pre_backward(module, *unused):
            log.append("root_pre_backward")

        @torch.compiler.disable
        def _process_post_backward_gradients(params):
            log.append("process_grads")

        def create_custom_backward_hook(module, custom_backward_handler):
            @torch.compiler.disable
            def forward_hook(_module, inputs, output):
                outputs = [output] if torch.is_tensor(output) else list(output)
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads: custom_backward_handler(_module, grads), mode="any")
                return output

            return module.register_forward_hook(forward_hook)

        unit.register_forward_pre_hook(_pre_forward_param_unshard, prepend=True, with_kwargs=True)
        unit.register_forward_hook(_post_forward, prepend=False)
        create_custom_backward_hook(unit, _pre_backward_param_unshard)
        unit.register_forward_pre_hook(
            functools.partial(_register_post_backward_hook, _post_backward_release_module), with_kwargs=True)
        if root is not None:
            create_custom_backward_hook(root, _root_pre_backward)
        for i, p in enumerate(unit.parameters()):
            self.grad_acc_hooks[f"param {i}"] = p.register_post_accumulate_grad_hook(
                lambda p: _process_post_backward_gradients([p]))
        mf.mark_module_hooks((root or unit).modules())
        return self


def fake_make_graphed_callables(callables, sample_args, *, capture_time_hooks=None, log=None, warmup=2,
                                capturing=None):
    """TE 2.20.2's make_graphed_callables contract, without graphs: refuses callables with
    hooks, checks the capture_time_hooks keys, runs ``hook(module)`` (None required) around a
    warm-up forward and backward of each callable, as TE does outside the captured graphs."""
    for c in callables:
        if any(len(getattr(c, d)) for d in cg.MODULE_HOOK_DICTS.values()):
            raise RuntimeError("Modules must not have hooks registered at the time they are passed.")
    hooks = capture_time_hooks or [None] * len(callables)
    assert len(hooks) == len(callables)
    for entry in hooks:
        assert entry is None or set(entry) <= set(cg.TE_HOOK_KEYS), entry

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


def unit_and_log(with_root=False):
    log = []
    unit = torch.nn.Linear(4, 4)
    root = torch.nn.Sequential(unit) if with_root else None
    registrar = MegatronFSDP(log)._register_fsdp_hooks(unit, root)
    return unit, root, registrar, log


def hook_ids(module):
    return {kind: list(getattr(module, d)) for kind, d in cg.MODULE_HOOK_DICTS.items()}


def test_markers_name_the_inner_handlers():
    unit, root, _, _ = unit_and_log(with_root=True)
    roles = {}
    for module in (unit, root):
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for fn in table.values():
                roles.setdefault(mf.local_name(fn), set()).add(mf.mark_hook(fn))
    assert roles == {
        "_pre_forward_param_unshard": {"plain"},
        "_post_forward": {"plain"},
        "_register_post_backward_hook": {"backward"},
        "create_custom_backward_hook.<locals>.forward_hook": {"backward_pre", "withhold"},
    }
    wrapper = next(fn for fn in unit._forward_pre_hooks.values() if isinstance(fn, functools.partial))
    assert mf.local_name(getattr(wrapper, mf.BACKWARD_HANDLER)) == "_post_backward_release_module"
    assert mf.local_name(torch.nn.Linear.forward) is None and mf.mark_hook(print) is None


def test_unknown_fsdp_hook_is_a_drift_error():
    def _new_hook(module, *unused):
        return None

    _new_hook.__qualname__ = "MegatronFSDP._register_fsdp_hooks.<locals>._new_hook"
    with pytest.raises(mf.FSDPHookDriftError, match="_new_hook"):
        mf.mark_hook(_new_hook)


def test_take_off_reroute_restore_twice():
    unit, _, registrar, log = unit_and_log()
    capturing = [False]
    mf.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0])
    before = hook_ids(unit)
    tables = {d: id(getattr(unit, d)) for d in cg.MODULE_HOOK_DICTS.values()}
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        stash = cg.take_off_hooks(unit)
        assert all(not getattr(unit, d) for d in cg.MODULE_HOOK_DICTS.values())
        te = cg.capture_time_hooks(stash, "layer 1")
        assert set(te) == set(cg.TE_HOOK_KEYS)
        # One handler per key; the wrappers themselves are not among the values.
        assert {k: len(v) for k, v in te.items()} == dict.fromkeys(cg.TE_HOOK_KEYS, 1)
        given = [fn.__wrapped__ for table in te.values() for fn in table.values()]
        assert not any(isinstance(fn, functools.partial) for fn in given)
        assert "create_custom_backward_hook.<locals>.forward_hook" not in [mf.local_name(fn) for fn in given]
        assert mf.local_name(next(iter(te["backward_pre_hooks"].values())).__wrapped__) == "_pre_backward_param_unshard"
        assert mf.local_name(next(iter(te["backward_hooks"].values())).__wrapped__) == "_post_backward_release_module"
        log.clear()
        capturing[0] = True
        fake_make_graphed_callables([unit], [(x,)], capture_time_hooks=[te], log=log, warmup=1)
        capturing[0] = False
        # Exactly the eager sequence, each handler once (wrappers withheld, inner handlers
        # rerouted), and no gradient processing during capture.
        assert log == ["unshard", "fwd", "reshard", "pre_backward_unshard", "bwd", "post_backward_release"]
        cg.restore_hooks(stash)
        cg.restore_hooks(stash)  # idempotent
        assert hook_ids(unit) == before
        assert {d: id(getattr(unit, d)) for d in cg.MODULE_HOOK_DICTS.values()} == tables
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
    stash = cg.take_off_hooks(unit)
    unit.register_forward_hook(lambda m, i, o: calls.append("b"))
    cg.restore_hooks(stash)
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
    stash = cg.take_off_hooks(unit)
    with pytest.raises(cg.CudaGraphHookError, match="my_logging_hook.*layer 3"):
        cg.capture_time_hooks(stash, "layer 3")
    cg.restore_hooks(stash)
    assert len(unit._forward_hooks) == 1
    assert cg.capture_time_hooks(cg.take_off_hooks(torch.nn.Linear(2, 2))) is None


def test_root_wrapper_is_withheld_and_fsdp_hooks_inside_a_layer_are_refused():
    unit, root, _, _ = unit_and_log(with_root=True)
    stash = cg.take_off_hooks(root)
    te = cg.capture_time_hooks(stash, "root")
    assert te is None  # the only hook on the root is the withheld root pre-backward wrapper
    cg.restore_hooks(stash)
    with pytest.raises(cg.CudaGraphHookError, match="inside a layer"):
        cg.check_no_hooks_inside(root, "layer 1")
    cg.check_no_hooks_inside(unit, "layer 1")


def test_gradient_hooks_pause_while_capturing():
    unit, _, registrar, log = unit_and_log()
    capturing = [True]
    assert mf.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0]) == 2
    assert mf.guard_gradient_hooks(registrar.grad_acc_hooks.values(), lambda: capturing[0]) == 2  # no double wrap
    stash = cg.take_off_hooks(unit)
    unit(torch.randn(2, 4)).sum().backward()
    assert "process_grads" not in log
    capturing[0] = False
    unit(torch.randn(2, 4)).sum().backward()
    assert log.count("process_grads") == 2
    cg.restore_hooks(stash)
    handle = next(iter(registrar.grad_acc_hooks.values()))
    handle.remove()  # the handle still refers to the guarded entry
    log.clear()
    unit(torch.randn(2, 4)).sum().backward()
    assert log.count("process_grads") == 1


# ---------------------------------------------------------------------------------------
# The capture helper subclass, over a stand-in for megatron's TECudaGraphHelper
# ---------------------------------------------------------------------------------------


class FakeHelper:
    """The parts of megatron's TECudaGraphHelper the fork's subclass builds on."""

    def __init__(self, layers, log, fail=False):
        self.flattened_callables = layers
        self.model, self.config, self.log, self.fail = [], types.SimpleNamespace(), log, fail
        self.deleted = False

    def _get_cuda_graph_input_data(self):
        return [(torch.randn(2, 4, requires_grad=True),) for _ in self.flattened_callables], {"allow_unused_input": True}

    def create_cudagraphs(self):
        from megatron.core.transformer import cuda_graphs as mcore_graphs

        mcore_graphs._set_capture_start()  # megatron's _start_capturing
        sample_args, kwargs = self._get_cuda_graph_input_data()
        if self.fail:
            raise RuntimeError("capture failed")  # megatron leaves its capture flag set
        fake_make_graphed_callables(self.flattened_callables, sample_args,
                                    capture_time_hooks=kwargs.get("capture_time_hooks"), log=self.log, warmup=1)
        mcore_graphs._set_capture_end()  # megatron's _finish_capturing

    def delete_cuda_graphs(self):
        self.deleted = True


@pytest.fixture
def helper_class(monkeypatch):
    raw = []
    monkeypatch.setattr(mf, "raw_parameters", _recording_raw_parameters(raw))
    return cg._helper_class(FakeHelper), raw


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
        mf.guard_gradient_hooks(registrar.grad_acc_hooks.values())  # megatron-core's capture flag
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


# ---------------------------------------------------------------------------------------
# Patches on GraphableMegatronModule, applied through the registry
# ---------------------------------------------------------------------------------------

MODULE_PATCHES = ("cuda_graphs.hooks_fire_on_graphed_call", "cuda_graphs.capture_uses_original_forward",
                  "cuda_graphs.static_inputs_params_dtype")


@pytest.fixture
def module_patches():
    names = patches.apply_patches([patches.get(n) for n in MODULE_PATCHES])
    yield
    patches.revert(names)


def graphable(params_dtype=torch.float32):
    from megatron.core.transformer.module import GraphableMegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1,
                               cuda_graph_impl="transformer_engine", params_dtype=params_dtype)

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
    for name in MODULE_PATCHES + ("cuda_graphs.fsdp_capture_helper", mf.PATCH_NAME):
        patch = patches.get(name)
        assert patch.kind == "feature" and "4232" in patch.upstream_pr and patch.reason
    args = types.SimpleNamespace(use_megatron_fsdp=True, cuda_graph_impl="transformer_engine")
    eager = types.SimpleNamespace(use_megatron_fsdp=True, cuda_graph_impl="none")
    ddp_graphs = types.SimpleNamespace(use_megatron_fsdp=False, cuda_graph_impl="transformer_engine", bf16=False)
    bf16_graphs = types.SimpleNamespace(use_megatron_fsdp=False, cuda_graph_impl="transformer_engine", bf16=True)
    assert patches.get("cuda_graphs.fsdp_capture_helper").wanted(args)
    assert not patches.get("cuda_graphs.fsdp_capture_helper").wanted(eager)
    assert not patches.get("cuda_graphs.fsdp_capture_helper").wanted(ddp_graphs)
    assert patches.get("cuda_graphs.static_inputs_params_dtype").wanted(ddp_graphs)
    # a bf16 model gets upstream's bf16 capture inputs already: no patch, so upstream mode can graph it
    assert not patches.get("cuda_graphs.static_inputs_params_dtype").wanted(bf16_graphs)


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
    assert "forward" not in vars(layer) and cg.ORIGINAL_FORWARD not in vars(layer)
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


# ---------------------------------------------------------------------------------------
# Drift: the real Megatron-FSDP still registers what the markers expect
# ---------------------------------------------------------------------------------------


def _local_code_objects(code, prefix=""):
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const.co_qualname, const
            yield from _local_code_objects(const)


def test_real_megatron_fsdp_hook_functions_are_known():
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    local = dict(_local_code_objects(MegatronFSDP._register_fsdp_hooks.__code__))
    prefix = "MegatronFSDP._register_fsdp_hooks.<locals>."
    for name in ("_pre_forward_param_unshard", "_post_forward", "_register_post_backward_hook",
                 "_post_backward_release_module", "_pre_backward_param_unshard", "_root_pre_backward",
                 "_release_module_fp8_transpose_cache", "create_custom_backward_hook.<locals>.forward_hook"):
        assert prefix + name in local, name
    assert local[prefix + "create_custom_backward_hook.<locals>.forward_hook"].co_freevars == ("custom_backward_handler",)
    # The capture helper and the adapter still look these names up.
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.training.training as training

    assert adapter.MegatronFSDP is MegatronFSDP
    assert training.TECudaGraphHelper.__name__ == "TECudaGraphHelper"
