# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

import functools
import sys
import types

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer import te_cuda_graph_hooks as hooks
from megatron.core.transformer.module import GraphableMegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def _fsdp_unit(log):
    """A module with hooks marked as Megatron-FSDP marks the hooks of an FSDP unit."""
    unit = torch.nn.Linear(4, 4)

    def unshard(module, args, kwargs):
        log.append("unshard")

    def release(module, args, output):
        log.append("release")

    def pre_backward_wrapper(module, args, output):
        log.append("pre_backward_wrapper")

    def post_backward_wrapper(handler, module, args, kwargs):
        log.append("post_backward_wrapper")

    unshard._cuda_graph_capture_time_safe = True
    release._cuda_graph_capture_time_safe = True
    pre_backward_wrapper._cuda_graph_backward_pre_handler = lambda m, *a: log.append("pre_bwd")
    post = functools.partial(post_backward_wrapper, lambda m, *a: log.append("post_bwd"))
    post._cuda_graph_backward_handler = post.args[0]
    unit.register_forward_pre_hook(unshard, with_kwargs=True)
    unit.register_forward_hook(release)
    unit.register_forward_hook(pre_backward_wrapper)
    unit.register_forward_pre_hook(post, with_kwargs=True)
    return unit


def _hook_ids(module):
    return {attr: list(getattr(module, attr)) for attr in hooks.MODULE_HOOK_DICTS.values()}


class TestCaptureTimeHooks:
    def test_hooks_are_routed_to_te_phases_and_restored(self):
        log = []
        unit = _fsdp_unit(log)
        before = _hook_ids(unit)
        stash = hooks.take_off_hooks(unit)
        assert not any(_hook_ids(unit).values())
        te = hooks.capture_time_hooks(stash, "layer 1")
        assert set(te) == set(hooks.TE_HOOK_KEYS)
        for key in hooks.TE_HOOK_KEYS:
            for hook in te[key].values():
                assert hook(unit) is None
        # the wrappers are not run, their handlers are; each in the phase it belongs to
        assert log == ["unshard", "release", "pre_bwd", "post_bwd"]
        hooks.restore_hooks(stash)
        hooks.restore_hooks(stash)
        assert _hook_ids(unit) == before

    def test_unmarked_hook_is_refused_and_root_wrapper_withheld(self):
        unit = torch.nn.Linear(4, 4)

        def my_hook(module, args, output):
            return None

        unit.register_forward_hook(my_hook)
        with pytest.raises(hooks.CudaGraphHookError, match="my_hook on layer 3"):
            hooks.capture_time_hooks(hooks.take_off_hooks(unit), "layer 3")

        root = torch.nn.Linear(4, 4)

        def root_wrapper(module, args, output):
            return None

        root_wrapper._cuda_graph_withhold = True
        root.register_forward_hook(root_wrapper)
        assert hooks.capture_time_hooks(hooks.take_off_hooks(root)) is None

    def test_marked_hook_inside_a_layer_is_refused(self):
        layer = torch.nn.Sequential(_fsdp_unit([]))
        with pytest.raises(hooks.CudaGraphHookError, match="inside a layer"):
            hooks.check_no_hooks_inside(layer, "layer 1")
        hooks.check_no_hooks_inside(layer[0], "layer 1")

    def test_gradient_hooks_pause_while_capturing(self):
        param = torch.nn.Parameter(torch.ones(2))
        seen, capturing = [], [True]
        handle = param.register_post_accumulate_grad_hook(lambda p: seen.append(p))
        guarded = hooks.guard_gradient_hooks([handle], lambda: capturing[0])
        param.sum().backward()
        assert seen == []
        capturing[0] = False
        param.sum().backward()
        assert len(seen) == 1
        hooks.unguard_gradient_hooks(guarded)
        capturing[0] = True
        param.sum().backward()
        assert len(seen) == 2

    def test_model_without_megatron_fsdp_is_left_alone(self):
        layer = _fsdp_unit([])
        before = _hook_ids(layer)
        with hooks.megatron_fsdp_capture([torch.nn.Sequential(layer)], [layer], None) as taken:
            assert taken is None and _hook_ids(layer) == before


def _graphable(params_dtype=torch.float32, bf16=False):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=1,
        cuda_graph_impl="transformer_engine",
        params_dtype=params_dtype,
        bf16=bf16,
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


class TestGraphableModuleHooks:
    def test_hooks_fire_around_capture_and_replay(self):
        layer = _graphable()
        events = []
        layer.register_forward_pre_hook(lambda m, a: events.append("pre"))
        layer.register_forward_hook(lambda m, a, o: events.append("post"))
        x = torch.randn(2, 4)
        cuda_graphs._set_capture_start()
        try:
            layer(x)  # capture: the module's own forward, once
        finally:
            cuda_graphs._set_capture_end()
        assert events == ["pre", "post"] and layer.calls == ["forward"]
        layer.cuda_graphs = [lambda *a, **k: (events.append("graph"), a[0])[1]]
        layer.current_microbatch = 0
        layer(x)  # replay
        assert events == ["pre", "post", "pre", "graph", "post"]
        assert "forward" not in vars(layer) and "_te_cuda_graph_forward" not in vars(layer)
        layer.eval()
        layer(x)  # eager
        assert layer.calls == ["forward", "forward"]

    @pytest.mark.parametrize(
        "params_dtype,bf16,expected",
        [
            (torch.float32, False, torch.float32),
            (torch.float16, False, torch.float16),
            (torch.bfloat16, True, torch.bfloat16),
        ],
    )
    def test_static_inputs_take_the_model_dtype(self, monkeypatch, params_dtype, bf16, expected):
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        layer = _graphable(params_dtype, bf16)
        hidden = layer.get_layer_static_inputs(seq_length=8, micro_batch_size=2)["hidden_states"]
        assert hidden.dtype == expected and hidden.shape == (8, 2, 4) and hidden.requires_grad


FSDP_TE_GRAPHS = [
    "--use-megatron-fsdp",
    "--ckpt-format",
    "fsdp_dtensor",
    "--cuda-graph-impl",
    "transformer_engine",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--fsdp-double-buffer",
    "--fsdp-db-use-persist-buf-on-alloc-fail",
    "--no-gradient-accumulation-fusion",
]


class TestValidateArgs:
    @staticmethod
    def _validate(monkeypatch, extra):
        from megatron.training.arguments import parse_args, validate_args

        for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        properties = types.SimpleNamespace(major=9, minor=0, name="H100", total_memory=80 << 30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: properties)
        argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64"]
        argv += ["--num-attention-heads", "4", "--seq-length", "128"]
        argv += ["--max-position-embeddings", "128", "--micro-batch-size", "1"]
        argv += ["--train-iters", "10", "--lr", "1e-4", "--bf16", "--mock-data"]
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
        monkeypatch.setattr(sys, "argv", argv + extra)
        args = parse_args()
        validate_args(args, {})
        return args

    def test_supported_config_is_accepted(self, monkeypatch):
        args = self._validate(monkeypatch, FSDP_TE_GRAPHS)
        assert args.use_megatron_fsdp and args.cuda_graph_impl == "transformer_engine"

    @pytest.mark.parametrize(
        "drop,extra,match",
        [
            ("--fsdp-double-buffer", [], "needs --data-parallel-sharding-strategy"),
            ("--no-gradient-accumulation-fusion", [], "--gradient-accumulation-fusion"),
            (None, ["--cuda-graph-warmup-steps", "0"], "--cuda-graph-warmup-steps 0"),
            (
                None,
                ["--megatron-fsdp-enable-fine-grained-param-gather"],
                "--megatron-fsdp-enable-fine-grained-param-gather",
            ),
        ],
    )
    def test_unsupported_config_is_refused(self, monkeypatch, drop, extra, match):
        flags = [flag for flag in FSDP_TE_GRAPHS if flag != drop] + extra
        with pytest.raises(AssertionError, match=match):
            self._validate(monkeypatch, flags)

    def test_other_graph_impls_are_not_checked(self, monkeypatch):
        flags = FSDP_TE_GRAPHS[: FSDP_TE_GRAPHS.index("--data-parallel-sharding-strategy")]
        flags = [flag if flag != "transformer_engine" else "local" for flag in flags]
        args = self._validate(monkeypatch, flags)
        assert args.cuda_graph_impl == "local"
