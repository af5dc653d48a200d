"""Worker for the CPU tests of ``--adam-impl`` under megatron's distributed optimizer:
pretrain_gpt.py's tiny local-spec MoE GPT (smaller still, without dropout) wrapped in megatron's
``DistributedDataParallel`` with ``use_distributed_optimizer``, stepped by the optimizer
``get_megatron_optimizer`` builds (a ``DistributedOptimizer`` each for the dense and the expert
parameters, chained), gradients reduced by ``finalize_model_grads``, on megatron's pretraining
sampler, in fresh processes (gloo).

One spawn runs several ``phases`` one after the other in the same process group (starting the
processes costs far more than a few steps of the tiny model). Each phase builds its model and
optimizer from the same seed and says what it does:

* ``name``: the phase's key in the records;
* ``impl``: ``megatron`` (megatron-core's own Adam: torch's AdamW on a machine without
  TransformerEngine) or an ``--adam-impl`` value (its patches applied with ``registry.apply``,
  reverted after the phase; megatron seen as on a machine with TransformerEngine);
* ``start`` / ``stop``: the iterations run are ``start + 1 .. stop``;
* ``load``: ``[folder, sharding]``, a checkpoint loaded before training as
  ``--ckpt-format torch_dist`` loads one (the model's and the optimizer's sharded state dicts,
  the optimizer's common state inside the latter, through megatron's distributed checkpointing;
  ``sharding`` is the distributed optimizer's ``distrib_optim_sharding_type``); ``save``:
  ``{sharding: folder}``, written after training;
* ``state_after``: the iteration (``start`` for right after the load) after which rank 0 writes
  the full main parameters and moments to ``<out>.<name>.pt``, each in the dtype its optimizer
  keeps it in;
* ``revert``: patch names left out after ``registry.apply``;
* ``ep``: the expert-parallel size (default 1); ``bf16``: bf16 model parameters;
* ``scale_loss``: the backward pass starts from ``optimizer.scale_loss(loss)`` and the MoE
  auxiliary loss's from ``optimizer.scale_loss(1)``, as megatron's training loop seeds them
  through ``config.grad_scale_func`` (default: from the loss itself, the auxiliary loss's scale
  left as it is);
  ``fold``: ``--ddp-scale-grads-in-loss``;
* ``overlap``: megatron's ``--overlap-grad-reduce --overlap-param-gather`` in buckets of
  :data:`OVERLAP_BUCKET` parameters: each bucket's reduce-scatter starts in the backward pass once
  its gradients are in, and the parameter all-gather after a step waits for the next forward
  pass's hooks; as in megatron's ``train()`` the phase's first iteration runs without those hooks
  (on the parameters as built or loaded) and they come back after its step; before a save the
  parameters are gathered as megatron's ``save_checkpoint_and_time`` does (``force_param_sync``),
  unless ``stale_save`` (the other ranks' shards of the model's parameters saved as the last step
  left them);
* ``moments``: ``--adam-moments-dtype`` (default fp32);
* ``interpret``: Triton's interpreter on (``TRITON_INTERPRET=1``); ``block``: the one-kernel
  step's block (elements per program, default ``triton_step.BLOCK``). The interpreter runs each
  program in Python, so a larger block steps in fewer of them; the update is element-wise and
  masked at each tensor's end, the same for any block.

Each rank writes ``<out>.rank<r>.json``: per phase the patches applied, the scaling factors of
DDP's gradient buckets as built (``bucket_factors``), the inner optimizers
(class, fused), per iteration the loss, the gradient norm and the steps its Adams hold, the clip
scale each step read, after a load the steps the checkpoint's parameter groups carried, the
steps loaded and the dtypes of the moments loaded (``loaded_dtypes``), the dtypes of the moments
after the last iteration (``dtypes``); whether the one-kernel step ran, and with bf16 parameters
whether DDP's bf16 shards equal their fp32 main shards rounded, whether megatron's copy found
them written and the ``torch._foreach_copy_`` calls; ``error``: what a phase raised.
"""

import copy
import datetime
import json
import os
import sys
import traceback

# The checkpoint tests' smaller model, and no dropout: runs compare their losses to the bit
# without carrying the CPU generator's state through a checkpoint.
SMALL = {
    "--hidden-size": "64",
    "--ffn-hidden-size": "128",
    "--moe-ffn-hidden-size": "64",
    "--num-attention-heads": "4",
    "--vocab-size": "512",
    "--hidden-dropout": "0",
    "--attention-dropout": "0",
}
# Below the tiny model's gradient norms (0.6 to 0.8 over the first steps), so that the clip
# scales every step.
CLIP_GRAD = "0.5"


def dist_opt_argv(world_size):
    """The CPU config with ``--use-distributed-optimizer`` at ``world_size`` data-parallel ranks,
    one micro-batch each."""
    from megatron.patchset.core import argsfile
    from tests.unit.support import cpu_train

    argv = cpu_train.cpu_argv("--global-batch-size", str(2 * world_size))
    for flag, value in {**SMALL, "--clip-grad": CLIP_GRAD}.items():
        argv = argsfile.override(argv, flag, value)
    return argv + ["--use-distributed-optimizer", "--num-workers", "0"]


def _test_only_shims(patcher, torch):
    """megatron's optimizers tell bf16 from fp32 parameters by their CUDA type name
    (``torch.cuda.BFloat16Tensor``), and make their scalars (the gradient norm, the found-inf
    flag) and checkpoint buffers with ``device="cuda"``: answer the first for CPU tensors, make
    the others on the CPU. Test-only, like :mod:`.cpu_shims`."""
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    def on_the_cpu(real):
        def make(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = None
            return real(*args, device=device, **kwargs)

        return make

    patcher.setattr(torch.Tensor, "type", cuda_type)
    for name in ("tensor", "zeros", "empty", "empty_like"):
        patcher.setattr(torch, name, on_the_cpu(getattr(torch, name)))


def _as_on_a_te_machine(patcher):
    """megatron builds its Adam through the name ``megatron.core.optimizer.Adam`` (the one
    ``--adam-impl`` replaces) only where TransformerEngine or apex is installed; without them it
    takes ``torch.optim.AdamW`` directly. The ``--adam-impl`` phases see megatron as on the GPU
    machines, which have TransformerEngine: it builds Adam through that name, and its distributed
    optimizer reads and writes the step as it does for TE's FusedAdam (its module flags
    ``HAVE_APEX_OR_TE`` and ``USING_TE_OPTIMIZER``)."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer

    patcher.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    patcher.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    patcher.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)


def _distributed_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _steps(optimizer):
    """The steps the inner Adam's parameters hold (distinct, sorted), per distributed
    optimizer."""
    return [
        sorted({float(s["step"]) for s in opt.optimizer.state.values() if "step" in s})
        for opt in _distributed_optimizers(optimizer)
    ]


def _state_dtypes(optimizer):
    """{exp_avg, exp_avg_sq: the dtypes (distinct, sorted names) of that moment over the inner
    Adam's parameters}, per distributed optimizer."""
    return [
        {
            key: sorted({str(s[key].dtype) for s in opt.optimizer.state.values() if key in s})
            for key in ("exp_avg", "exp_avg_sq")
        }
        for opt in _distributed_optimizers(optimizer)
    ]


def _full_state(optimizer, model, torch):
    """{name: {param, exp_avg, exp_avg_sq}} of every parameter: each rank fills the range of the
    flattened parameter its shard holds, summed over the optimizer's data-parallel group (each
    element is held by one rank). Each tensor is then in the dtype this rank keeps it in (the
    sum is in fp32, exact for bf16 values); fp32 where this rank holds nothing of the
    optimizer."""
    names = {param: name for name, param in model.named_parameters()}
    full = {}
    for opt in _distributed_optimizers(optimizer):
        every = [param for buffer in opt.buffers for param in buffer.param_index_map]
        kept = {}
        for param in opt.model_param_gbuf_map:
            for key, value in opt._get_main_param_and_optimizer_states(param).items():
                kept.setdefault(key, set()).add(value.dtype)
        assert all(len(dtypes) == 1 for dtypes in kept.values()), kept
        for param in sorted(every, key=lambda p: names[p]):
            tensors = {
                key: torch.zeros(param.numel(), dtype=torch.float32)
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
            if param in opt.model_param_gbuf_map:  # this rank holds a part of it
                shard = opt._get_model_param_range_map(param)["param"]
                local = opt._get_main_param_and_optimizer_states(param)
                for key, value in tensors.items():
                    value[shard.start : shard.end] = local[key].detach().float()
            for key, value in tensors.items():
                torch.distributed.all_reduce(value, group=opt.data_parallel_group)
                dtype = next(iter(kept.get(key, {torch.float32})))
                tensors[key] = value.view(param.shape).to(dtype)
            full[names[param]] = tensors
    return full


def _bf16_shards(optimizer, torch):
    """Whether every bf16 shard of DDP's parameter buffer equals its fp32 main shard rounded to
    bf16 (None without bf16 parameters), and the shards' count."""
    pairs = [
        (model, main)
        for opt in _distributed_optimizers(optimizer)
        for models, mains in zip(opt.shard_float16_groups, opt.shard_fp32_from_float16_groups)
        for model, main in zip(models, mains)
    ]
    if not pairs:
        return None, 0
    return all(torch.equal(model, main.to(torch.bfloat16)) for model, main in pairs), len(pairs)


def _recorded(take, answers):
    """``take_model_copy`` that also appends each answer (whether megatron's copy after a step
    found the bf16 shards written) to ``answers``."""

    def take_model_copy(owner):
        answer = take(owner)
        answers.append(answer)
        return answer

    return take_model_copy


def _metadata(sharding):
    return {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False}


def _save(folder, sharding, model, optimizer, dist_checkpointing, torch):
    state = {"model": model.sharded_state_dict(metadata=_metadata(sharding))}
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], is_loading=False, metadata=_metadata(sharding)
    )
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, folder)


def _load(folder, sharding, model, optimizer, dist_checkpointing, torch, record):
    state = {"model": model.sharded_state_dict(metadata=_metadata(sharding))}
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], is_loading=True, metadata=_metadata(sharding)
    )
    loaded = dist_checkpointing.load(state, folder)
    record["checkpoint_group_steps"] = [
        group.get("step") for group in loaded["optimizer"]["optimizer"]["param_groups"]
    ]
    # Under no_grad: with fp32 parameters the main shards are views of the parameters, and
    # megatron's dp_reshardable load copies into them in place, which autograd refuses outside it
    # (with bf16 parameters the main shards are copies).
    with torch.no_grad():
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])


def _phase_args(args, phase, torch):
    """The parsed arguments with the phase's ``--adam-impl``, expert-parallel size,
    ``--adam-moments-dtype`` and, for a bf16 phase, what megatron's validation derives from
    ``--bf16``."""
    phase_args = copy.copy(args)
    phase_args.adam_impl = "te" if phase["impl"] == "megatron" else phase["impl"]
    phase_args.expert_model_parallel_size = phase.get("ep", args.expert_model_parallel_size)
    phase_args.adam_moments_dtype = phase.get("moments", "fp32")
    phase_args.ddp_scale_grads_in_loss = phase.get("fold", False)
    if phase.get("bf16"):
        phase_args.bf16 = True
        phase_args.params_dtype = torch.bfloat16
        phase_args.accumulate_allreduce_grads_in_fp32 = True
    return phase_args


# Parameters per DDP bucket for an ``overlap`` phase: several buckets in the tiny model, so that
# reduce-scatters start while the backward pass goes on.
OVERLAP_BUCKET = 20000


def _build(args, m, torch, overlap=False):
    """The model (its GPTModel, and the whole wrapped in megatron's DDP) and the optimizer, as
    megatron's training builds them."""
    torch.manual_seed(1234)
    gpt = m.GPTModelBuilder(m.pretrain_gpt.model_config_from_args(args)).build_model(
        m.ProcessGroupCollection.use_mpu_process_groups()
    )
    config = gpt.config
    module = m.Float16Module(config, gpt) if args.bf16 else gpt
    ddp_config = m.DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        bucket_size=OVERLAP_BUCKET if overlap else None,
    )
    model = m.DistributedDataParallel(config, ddp_config, module)
    optimizer = m.get_megatron_optimizer(
        m.OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=args.params_dtype,
            use_distributed_optimizer=True,
            overlap_param_gather=overlap,
        ),
        [model],
    )
    return gpt, model, optimizer


def _observe(optimizer, record, patcher, torch):
    """Record the clip scale each inner Adam step reads (``grad_scales``: set by the patched
    clip, None where megatron clips the gradients itself), each answer of the one-kernel step to
    megatron's copy (``copies_taken``) and the ``torch._foreach_copy_`` calls
    (``foreach_copies``)."""
    record.update(grad_scales=[], copies_taken=[], foreach_copies=0)
    for opt in _distributed_optimizers(optimizer):
        opt.optimizer.register_step_pre_hook(
            lambda inner, *_: record["grad_scales"].append(
                None if getattr(inner, "grad_scale", None) is None else float(inner.grad_scale)
            )
        )
        take = getattr(opt.optimizer, "take_model_copy", None)
        if take is not None:
            opt.optimizer.take_model_copy = _recorded(take, record["copies_taken"])
    real_copy = torch._foreach_copy_

    def foreach_copy(*args, **kwargs):
        record["foreach_copies"] += 1
        return real_copy(*args, **kwargs)

    patcher.setattr(torch, "_foreach_copy_", foreach_copy)


def _dump_state(optimizer, gpt, path, torch):
    state = _full_state(optimizer, gpt, torch)
    if torch.distributed.get_rank() == 0:
        torch.save(state, path)


def _phase(phase, args, out, torch, m):
    """Build, load, train and save as ``phase`` says; returns its record."""
    import pytest

    from megatron.patchset.core import registry
    from megatron.patchset.features.torch_adam import triton_step

    record = {"name": phase["name"], "iterations": [], "losses": [], "grad_norms": []}
    record["steps"] = []
    phase_args = _phase_args(args, phase, torch)
    patcher = pytest.MonkeyPatch()
    applied = registry.apply(phase_args)
    registry.revert(phase.get("revert", ()))
    record["applied"] = sorted(set(applied) - set(phase.get("revert", ())))
    if phase["impl"] != "megatron":
        _as_on_a_te_machine(patcher)
    if phase.get("interpret"):
        patcher.setenv("TRITON_INTERPRET", "1")
    if phase.get("block"):
        patcher.setattr(triton_step, "BLOCK", phase["block"])
    # the Adam factory reads --adam-moments-dtype from megatron's global arguments
    patcher.setattr(args, "adam_moments_dtype", phase_args.adam_moments_dtype)
    triton_step._kernel.cache_clear()
    state_path = f"{out}.{phase['name']}.pt"
    try:
        ep = phase_args.expert_model_parallel_size
        if m.parallel_state.get_expert_model_parallel_world_size() != ep:
            m.parallel_state.destroy_model_parallel()
            m.parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        gpt, model, optimizer = _build(phase_args, m, torch, overlap=phase.get("overlap", False))
        record["overlap_param_gather"] = model.ddp_config.overlap_param_gather
        record["buckets"] = sum(
            len(buffer.buckets) for buffer in (*model.buffers, *model.expert_parallel_buffers)
        )
        record["bucket_factors"] = sorted(
            {
                float(bucket.gradient_scaling_factor)
                for buffer in (*model.buffers, *model.expert_parallel_buffers)
                for bucket in buffer.buckets
            }
        )
        record["inner"] = [
            [type(o.optimizer).__name__, bool(o.optimizer.defaults.get("fused"))]
            for o in _distributed_optimizers(optimizer)
        ]
        _observe(optimizer, record, patcher, torch)
        start, stop = phase.get("start", 0), phase["stop"]
        if phase.get("load"):
            folder, sharding = phase["load"]
            _load(folder, sharding, gpt, optimizer, m.dist_checkpointing, torch, record)
            record["loaded_steps"] = _steps(optimizer)
            record["loaded_dtypes"] = _state_dtypes(optimizer)
            if phase.get("state_after") == start:
                _dump_state(optimizer, gpt, state_path, torch)
        train, _, _ = m.pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])
        loader = iter(m.build_pretraining_data_loader(train, start * args.global_batch_size))
        overlap = phase.get("overlap", False)
        if overlap:
            # megatron's train(): the first iteration runs without the forward hooks (no
            # parameter all-gather), on the parameters as built or loaded; they come back after
            # its step
            model.disable_forward_pre_hook(param_sync=False)
        for iteration in range(start + 1, stop + 1):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            if phase.get("scale_loss"):  # the MoE auxiliary loss's, as megatron's forward step
                m.MoEAuxLossAutoScaler.set_loss_scale(optimizer.scale_loss(torch.ones(1)))
            output, loss_fn = m.pretrain_gpt.forward_step(loader, model)
            loss, num_tokens, _ = loss_fn(output)
            seed = loss / num_tokens
            if phase.get("scale_loss"):
                seed = optimizer.scale_loss(seed)
            seed.backward()
            m.finalize_model_grads([model])
            ok, grad_norm, _ = optimizer.step()
            assert ok
            if overlap and iteration == start + 1:
                model.enable_forward_pre_hook()
                record["gather_hooks"] = len(model.remove_forward_pre_hook_handles)
            record["iterations"].append(iteration)
            record["losses"].append(float(loss.detach() / num_tokens))
            record["grad_norms"].append(float(grad_norm))
            record["steps"].append(_steps(optimizer))
            if phase.get("state_after") == iteration:
                _dump_state(optimizer, gpt, state_path, torch)
        record["dtypes"] = _state_dtypes(optimizer)
        record["kernel"] = [
            getattr(o.optimizer, "_plan", None) is not None
            for o in _distributed_optimizers(optimizer)
        ]
        record["bf16_shards"], record["bf16_shard_count"] = _bf16_shards(optimizer, torch)
        if overlap and phase.get("save") and not phase.get("stale_save"):
            # megatron's save_checkpoint_and_time: gather the parameters the last step updated
            optimizer.prepare_model_params_for_param_sync()
            model.start_param_sync(force_sync=True)
        for sharding, folder in phase.get("save", {}).items():
            _save(folder, sharding, gpt, optimizer, m.dist_checkpointing, torch)
    except Exception as exc:  # a phase's failure is what some tests assert
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    finally:
        patcher.undo()
        registry.revert(applied)
        triton_step._kernel.cache_clear()
    return record


def run(rank, world_size, port, out, phases):
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import types

    import pytest
    import torch

    from tests.unit.support import cpu_shims

    patcher = pytest.MonkeyPatch()
    cpu_shims.install(patcher)
    _test_only_shims(patcher, torch)
    sys.argv = ["pretrain_gpt.py", *dist_opt_argv(world_size)]
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.models.gpt import GPTModelBuilder

    import pretrain_gpt

    m = types.SimpleNamespace(
        dist_checkpointing=dist_checkpointing,
        parallel_state=parallel_state,
        DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads,
        OptimizerConfig=OptimizerConfig,
        get_megatron_optimizer=get_megatron_optimizer,
        ProcessGroupCollection=ProcessGroupCollection,
        Float16Module=Float16Module,
        MoEAuxLossAutoScaler=MoEAuxLossAutoScaler,
        build_pretraining_data_loader=build_pretraining_data_loader,
        GPTModelBuilder=GPTModelBuilder,
        pretrain_gpt=pretrain_gpt,
    )
    # One intra-op thread per rank: the runs must agree to the bit (see cpu_resume.py).
    torch.set_num_threads(1)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.add_patchset_args)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    parallel_state.initialize_model_parallel()
    records = {}
    try:
        for phase in phases:
            records[phase["name"]] = _phase(phase, args, out, torch, m)
    finally:
        with open(f"{out}.rank{rank}.json", "w") as handle:
            json.dump(records, handle)
        torch.distributed.destroy_process_group()
