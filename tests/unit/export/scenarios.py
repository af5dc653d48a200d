"""Scenarios run in a subprocess, once with the overlay and once on an exported megatron with
``MEGATRON_PATCHSET=off``; prints one JSON object that the two runs must agree on.

Usage: ``python -m tests.unit.export.scenarios OUT.json`` (from the repository root).
What is observed goes through upstream's symbols only, never the fork's feature modules: the
``--dry-run`` rule outcomes, the classes megatron's model builder, FSDP adapter and training loop
use, the bookkeeping of the FSDP hooks by the installed FSDP class, the schedule plan that the
model builder's GPTModel builds with the P2P-overlap flags, and what megatron's TEGroupedMLP
computes over the spec provider's grouped-GEMM linears with the token counts on the device.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import warnings

from megatron.patchset.core import argsfile, registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = argsfile.read(os.path.join(ROOT, "examples", "configs", "tiny_moe.args"))
FSDP = [
    "--use-megatron-fsdp",
    "--ckpt-format",
    "fsdp_dtensor",
    "--data-parallel-sharding-strategy",
    "optim_grads_params",
    "--no-gradient-accumulation-fusion",
]
FSDP_GRAPHS = FSDP + ["--cuda-graph-impl", "transformer_engine", "--fsdp-double-buffer"]
P2P_PIPELINE = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
    "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
]
# name -> (flags beyond the tiny config, world size)
DRY_RUNS = {
    "plain": ([], 1),
    "fsdp_graphs_need_persistent_buffer": (FSDP_GRAPHS, 1),
    "fsdp_graphs_no_double_buffer": (FSDP + ["--cuda-graph-impl", "transformer_engine"], 1),
    "fsdp_local_graphs": (FSDP + ["--cuda-graph-impl", "local"], 1),
    "fsdp_graphs_valid": (FSDP_GRAPHS + ["--fsdp-db-use-persist-buf-on-alloc-fail"], 1),
    "p2p_without_ep_overlap": (["--overlap-p2p-backward-on-comm-stream"], 1),
    "p2p_layer_number_zero": (["--overlap-p2p-wgrad-delayed-layer-number", "0"], 1),
    "p2p_layer_number_too_large": (
        P2P_PIPELINE + ["--overlap-p2p-wgrad-delayed-layer-number", "5"],
        4,
    ),
    "p2p_valid": (
        P2P_PIPELINE
        + [
            "--overlap-p2p-wgrad-delayed-layer-number",
            "1",
            "--overlap-p2p-backward-on-comm-stream",
        ],
        4,
    ),
}
GROUPED_MM = ["--moe-grouped-gemm-impl", "torch"]
FULL_ITERATION = [
    "--moe-expert-splits-on-device",
    "--moe-permute-fusion",
    "--cuda-graph-impl",
    "full_iteration",
    "--cuda-graph-warmup-steps",
    "2",
    "--no-check-for-nan-in-loss-and-grad",
]
# grouped_mm's flags that pass its rules are not among them: an exported megatron installs the
# grouped-GEMM linears at the end of validate_args, which refuses without TransformerEngine (not
# installed on the CPU), while the overlay's --dry-run checks the rules without installing them.
DRY_RUNS.update(
    {
        "grouped_mm_requirements": (
            GROUPED_MM
            + ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "0"]
            + ["--use-transformer-engine-op-fuser"],
            1,
        ),
        "grouped_mm_alignment": (GROUPED_MM + ["--moe-ffn-hidden-size", "500"], 1),
        "splits_without_grouped_mm": (
            ["--moe-expert-splits-on-device", "--expert-model-parallel-size", "2"],
            2,
        ),
        "full_iteration_timers": (
            GROUPED_MM + FULL_ITERATION + ["--timing-log-level", "1"],
            1,
        ),
        "full_iteration_dropless": (
            ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
            1,
        ),
    }
)
GROUPED_MM_PATCHES = (
    "grouped_mm.fc1",
    "grouped_mm.fc2",
    "grouped_mm.splits_on_device_grouped_mlp",
)
# megatron's failure message adds "(--flag)" after config field names it recognises
_FIELD_FLAG = re.compile(r"(\b\w+_\w+\b) \((--[a-z0-9-]+)\)")


def dry_run(argv: list[str], world: int) -> dict:
    from megatron.patchset.core import dry_run as dry

    os.environ["WORLD_SIZE"] = str(world)
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        code = dry.run(TINY + argv, out=out)
    text = _FIELD_FLAG.sub(r"\1", out.getvalue())
    fired = {
        name: sorted(set(re.findall(r"--[a-z0-9][a-z0-9-]*", message)))
        for name, message in re.findall(r"^\s*\[([a-z0-9-]+)\] (.*)$", text, re.MULTILINE)
    }
    return {"code": code, "rules": fired}


def parsed(argv: list[str], world: int):
    """Parsed and validated as pretrain_gpt.py does; the overlay then applies its patches (an
    exported megatron installs its own in validate_args)."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron.patchset.core.dry_run import target_device
    from megatron.patchset.core.flags import add_patchset_args

    os.environ["WORLD_SIZE"] = str(world)
    sys.argv = ["pretrain_gpt.py", *TINY, *argv]
    args = parse_args(add_patchset_args)
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate_args(args, {})
    registry.apply(args)
    return args


def _name(obj) -> str:
    obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return getattr(obj, "__qualname__", type(obj).__name__)


def fsdp_graph_classes() -> dict:
    """What megatron's own code finds under each fsdp_cuda_graphs target after a launch's set-up
    with the feature's flags, and the FSDP hook bookkeeping of the installed FSDP class."""
    parsed(FSDP_GRAPHS + ["--fsdp-db-use-persist-buf-on-alloc-fail"], 1)
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.training.training as training
    from megatron.core.transformer.module import GraphableMegatronModule

    from tests.unit.features.fsdp_cuda_graphs.fakes import unit_and_log

    fsdp = adapter.MegatronFSDP
    mark = fsdp._register_fsdp_hooks.__globals__["mark_module_hooks"]
    guard = fsdp._register_fsdp_hooks.__globals__["guard_gradient_hooks"]
    unit, root, registrar, _ = unit_and_log(with_root=True)
    counts = mark(list(root.modules()))
    markers = sorted(
        sorted(a for a in vars(getattr(fn, "func", fn)) if a.startswith("_cuda_graph"))
        for module in root.modules()
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for fn in hooks.values()
    )
    guarded = guard(registrar.grad_acc_hooks.values(), lambda: True)
    return {
        "MegatronFSDP": [c.__name__ for c in fsdp.__mro__[:2]],
        "TECudaGraphHelper": [c.__name__ for c in training.TECudaGraphHelper.__mro__[:2]],
        "__call__": _name(GraphableMegatronModule.__call__),
        "_te_cuda_graph_capture": _name(GraphableMegatronModule._te_cuda_graph_capture),
        "get_layer_static_inputs": _name(GraphableMegatronModule.get_layer_static_inputs),
        "hook_roles": counts,
        "hook_markers": markers,
        "guarded_gradient_hooks": guarded,
    }


def p2p_schedule_plan() -> dict:
    """The P2P-overlap options a launch's TransformerConfig carries, and the schedule plan the
    model builder's GPTModel builds with them (a small CPU model, as the feature's unit test)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.patchset.core import model_hooks
    from megatron.patchset.core.dry_run import target_device

    args = parsed(
        P2P_PIPELINE
        + ["--overlap-p2p-backward-on-comm-stream", "--overlap-p2p-with-transformer-layer-wgrad"],
        4,
    )
    names = (
        "overlap_p2p_backward_on_comm_stream",
        "overlap_p2p_wgrad_delayed_layer_number",
        "overlap_p2p_with_transformer_layer_wgrad",
    )
    with target_device(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        launch_config = core_transformer_config_from_args(args)
        model_hooks.configure_transformer_config(args, launch_config)
    options = {name: getattr(launch_config, name, None) for name in names}
    import megatron.training.models.gpt as builder

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
        for name, value in options.items():
            setattr(config, name, value)
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel()
        model = builder.GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
            vocab_size=128,
            max_sequence_length=16,
        )
    torch.cuda.Event = lambda *a, **k: object()  # no GPU: the plan only creates events
    tokens = torch.zeros(1, 8, dtype=torch.long)
    plan = model.build_schedule_plan(
        tokens, torch.arange(8)[None], None, labels=tokens, loss_mask=torch.ones(1, 8)
    )
    return {
        "options": options,
        "model": [c.__name__ for c in type(model).__mro__[:2]],
        "plan": [c.__name__ for c in type(plan).__mro__[:2]],
        "layers": [type(plan.get_layer(i)).__name__ for i in range(plan.num_layers())],
        "run": _name(type(plan).run),
        "layer_run": _name(type(plan.get_layer(0)).run),
    }


def grouped_mm_experts() -> dict:
    """Megatron's TEGroupedMLP over the grouped-GEMM linears that the spec provider hands out (TE's
    grouped linear replaced by the fake of the feature's unit tests: TE is not installed), called
    with a token-count tensor through the TEGroupedMLP.forward patch; on an exported tree the
    fork's shared definitions are the same objects in every module that uses them. ``tolist`` of
    a tensor raises meanwhile: the counts reach the GEMMs without a host list."""
    import hashlib
    from types import SimpleNamespace

    import megatron.core.extensions.transformer_engine_spec_provider as spec
    import megatron.core.transformer.moe.experts as experts
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.patchset.core import features
    from megatron.patchset.core.provided import provided_features
    from tests.unit.features.grouped_mm.conftest import IN, OUT, FakeTEGroupedLinear, rows

    spec.TEColumnParallelGroupedLinear = spec.TERowParallelGroupedLinear = FakeTEGroupedLinear
    if "grouped_mm" in provided_features():
        import megatron.core.transformer.moe.token_dispatcher as dispatcher
        import megatron.training.arguments as arguments

        assert spec.GroupedMMForward is experts.GroupedMMForward
        assert arguments.FLAG is spec.FLAG is experts.FLAG
        assert arguments.SPLITS_FLAG is experts.SPLITS_FLAG is dispatcher.SPLITS_FLAG
        assert arguments.ALIGNMENT == experts._ALIGNMENT  # the rules' and the GEMM probe's
        for name in ("DeviceSplits", "grouped_mm", "group_offsets", "_offsets_cache"):
            assert not hasattr(spec, name) and not hasattr(dispatcher, name), name
        spec._enable_grouped_mm_fc1()
        spec._enable_grouped_mm_fc2()
        experts._enable_grouped_mm_splits_on_device_grouped_mlp()
        offsets_cache = experts._offsets_cache
    else:
        from megatron.patchset.features.grouped_mm import torch_grouped_gemm

        features.load()
        registry.apply_patches([registry.get(name) for name in GROUPED_MM_PATCHES])
        offsets_cache = torch_grouped_gemm._offsets_cache

    splits = [3, 0, 6, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=1,
            hidden_size=IN,
            num_attention_heads=4,
            num_moe_experts=len(splits),
            moe_ffn_hidden_size=OUT,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bias_activation_fusion=False,
            moe_grouped_gemm=True,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
    submodules = experts.GroupedMLPSubmodules(
        linear_fc1=spec.TEColumnParallelGroupedLinear, linear_fc2=spec.TERowParallelGroupedLinear
    )
    with contextlib.redirect_stdout(io.StringIO()):
        mlp = experts.TEGroupedMLP(
            len(splits), config, submodules, pg_collection=SimpleNamespace(ep=None, expt_tp=None)
        )
    x = rows(sum(splits), IN).requires_grad_(True)
    probs = torch.rand(sum(splits), generator=torch.Generator().manual_seed(3))
    host_list = torch.Tensor.tolist

    def refuse(self):
        raise AssertionError("tokens_per_expert.tolist() called")

    torch.Tensor.tolist = refuse
    try:
        out, bias = mlp(x, torch.tensor(splits), probs)
        out.float().square().sum().backward()
    finally:
        torch.Tensor.tolist = host_list

    def digest(t) -> str:
        return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()

    weights = [p for _, p in sorted(mlp.named_parameters())]
    return {
        "linears": [
            [c.__name__ for c in type(m).__mro__[:3]] for m in (mlp.linear_fc1, mlp.linear_fc2)
        ],
        "bias": bias,
        "offsets_cache": len(offsets_cache),
        "output": digest(out),
        "input_grad": digest(x.grad),
        "weight_grads": [digest(p.grad) for p in weights],
    }


def main() -> None:
    from megatron.patchset.core.provided import provided_features

    path = sys.argv[1]  # the scenarios set sys.argv as pretrain_gpt.py's
    observed = {"dry_run": {name: dry_run(*case) for name, case in DRY_RUNS.items()}}
    observed["fsdp_cuda_graphs"] = fsdp_graph_classes()
    observed["p2p_overlap"] = p2p_schedule_plan()
    observed["grouped_mm"] = grouped_mm_experts()
    result = {"provided": sorted(provided_features()), "observed": observed}
    with open(path, "w") as handle:
        json.dump(result, handle, sort_keys=True)


if __name__ == "__main__":
    main()
