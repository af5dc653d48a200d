"""--compile-transformer-layers on the CPU: flags and validation rules, the patches, the modules
that get compiled (a mocked torch.compile records them), and real compiled training of the tiny
local-spec MoE GPT (backend aot_eager) checked against eager, with dynamo's counters: graph breaks
only at the eager MoE regions, no recompile after warm-up, a recompile after it is an error."""

import json
import math
import os
import sys

import pytest
import torch.multiprocessing as mp

from megatron.patchset import arguments as ps_args
from megatron.patchset import compile as ps_compile
from megatron.patchset import patches
from tests.unit.conftest import parse, tiny_argv, validated
from tests.unit.test_pretrain_gpt_cpu import _free_port, cpu_argv


def _cpu_router_gating(monkeypatch):
    """CPU-only: Router.gating moves a CPU weight to ``torch.cuda.current_device()`` with a
    ``.data =`` assignment on every call (dead code on GPUs, where the weight is already there),
    which would be a CPU-only graph break. Same computation without the move."""
    import torch
    from megatron.core.transformer.moe import router

    def gating(self, input):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router.router_gating_linear(input, self.weight, self.bias, dtype)

    monkeypatch.setattr(router.Router, "gating", gating)


def worker(rank, world_size, argv, port, out, steps, mode):
    """One process of a CPU run: build with the fork's hooks and patches, train, write JSON."""
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import pytest
    import torch

    from megatron.core.tensor_parallel import random as tp_random
    from tests.unit import cpu_shims

    real_fork = tp_random.CudaRNGStatesTracker.fork
    patcher = pytest.MonkeyPatch()
    cpu_shims.install(patcher)
    _cpu_router_gating(patcher)
    if mode == "real-fork":
        # megatron's own RNG-tracker fork instead of cpu_shims' no-op, the CPU generator's state
        # standing in for the CUDA one (dynamo skips torch.get_rng_state and
        # torch.cuda.get_rng_state alike), so that compiled code meets the fork as on a GPU.
        patcher.setattr(tp_random.CudaRNGStatesTracker, "fork", real_fork)
        patcher.setattr(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        patcher.setattr(tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    # CPU-only: dynamo evaluates torch.cuda.current_device() at trace time (a constant, as on a
    # GPU); cpu_shims' stand-in must be folded the same way or every call is a graph break.
    from torch._dynamo.variables import torch as dynamo_torch

    dynamo_torch.constant_fold_functions[torch.cuda.current_device] = None
    compiled_calls = []
    if mode == "mock":  # record what would be compiled, compile nothing
        def fake_compile(fn, **kwargs):
            compiled_calls.append({"owner": type(fn.__self__).__name__, "kwargs": kwargs})
            return fn

        patcher.setattr(torch, "compile", fake_compile)
    sys.argv = ["pretrain_gpt.py", *argv]
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron.patchset import compile as ps_compile
    from megatron.patchset import patches

    torch.manual_seed(1234)
    args = parse_and_validate_args(extra_args_provider=pretrain_gpt.ps_args.add_patchset_args)
    set_args(args)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.expert_model_parallel_size)
    if mode == "real-fork":
        tracker = tp_random.get_cuda_rng_tracker()
        for offset, name in enumerate((tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                                       tp_random.get_expert_parallel_rng_tracker_name(),
                                       tp_random.get_data_parallel_rng_tracker_name())):
            tracker.states_[name] = torch.Generator().manual_seed(4321 + offset).get_state()
    model_config = pretrain_gpt.model_config_from_args(args)
    applied = patches.apply(args)
    model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    for hook in model_config.pre_wrap_hooks:
        hook([model])
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    record = {"applied": applied, "losses": [], "stats": [], "error": None, "router_grads": []}
    record["compiled_forwards"] = sorted(
        name for name, m in model.named_modules()
        if getattr(m.__dict__.get("forward"), "__megatron_patchset_compiled__", False)
    )
    record["compiled_calls"] = compiled_calls
    record["eager_regions"] = {
        name: bool(getattr(patches.resolve_owner(target)[0], patches.resolve_owner(target)[1]).__dict__.get(
            "_torchdynamo_disable", False))
        for name, (target, *_) in ps_compile.EAGER_REGIONS.items()
    }
    record["dtoh_points"] = sorted({
        m.mlp.token_dispatcher.cuda_dtoh_point for m in model.modules() if hasattr(getattr(m, "mlp", None), "token_dispatcher")
    })
    seq_change_at = 4 if mode == "strict" else 0  # a shorter sequence after warm-up
    try:
        for step in range(steps):
            args.curr_iteration = step
            tokens = batch
            if seq_change_at and step == seq_change_at:
                tokens = {k: (v[:, :64] if torch.is_tensor(v) and v.dim() == 2 else v) for k, v in batch.items()}
                tokens["attention_mask"] = None
            output, loss_fn = pretrain_gpt.forward_step(iter([tokens]), model)
            loss, num_tokens, _ = loss_fn(output)
            # As megatron's schedule does for every micro-batch: the aux-loss gradient scale.
            # A different scale every step: a compiled backward holding a stale one would show.
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(step + 1)) / num_tokens)
            (loss / num_tokens).backward()
            if step == 0:
                record["grad_norms"] = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
            record["router_grads"].append(
                [p.grad.norm().item() for n, p in model.named_parameters() if "router" in n])
            optimizer.step()
            optimizer.zero_grad()
            record["losses"].append((loss / num_tokens).item())
            record["stats"].append(ps_compile.dynamo_stats())
    except Exception as exc:  # the strict-mode test expects one
        record["error"] = f"{type(exc).__name__}: {exc}"
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(record, handle)
    torch.distributed.destroy_process_group()


def train(tmp_path, world_size, *extra, mode="real", steps=6):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = str(tmp_path / mode)
    argv = cpu_argv("--global-batch-size", str(2 * world_size), *extra)
    mp.spawn(worker, args=(world_size, argv, _free_port(), out, steps, mode), nprocs=world_size, join=True)
    return [json.load(open(f"{out}.rank{r}.json")) for r in range(world_size)]


COMPILED = ("--compile-transformer-layers", "--compile-transformer-layers-backend", "aot_eager")
REGION_FUNCTIONS = ("MoELayer.dispatch", "MoELayer.routed_experts_compute", "MoELayer.combine")


def break_sites(stats):
    """The upstream function named by each graph-break reason."""
    sites = set()
    for reason in stats["graph_break_reasons"]:
        named = [f for f in REGION_FUNCTIONS if f"function {f} " in reason]
        sites.add(named[0] if named else reason.splitlines()[0])
    return sites


# ---------------------------------------------------------------------------------------
# Flags, rules, registry
# ---------------------------------------------------------------------------------------


def test_flags_default_off_and_parse():
    args = parse(tiny_argv())
    assert not ps_compile.requested(args)
    assert ps_compile.options_from_args(args) == ps_compile.CompileOptions()
    args = parse(tiny_argv(*COMPILED, "--compile-transformer-layers-warmup-iters", "3"))
    options = ps_compile.options_from_args(args)
    assert ps_compile.requested(args)
    assert options == ps_compile.CompileOptions(mode="default", backend="aot_eager", warmup_iters=3)
    assert options.compile_kwargs() == {"backend": "aot_eager"}
    args = parse(tiny_argv("--compile-transformer-layers", "--compile-transformer-layers-mode",
                           "max-autotune-no-cudagraphs"))
    assert ps_compile.options_from_args(args).compile_kwargs() == {
        "backend": "inductor", "mode": "max-autotune-no-cudagraphs"}
    assert [f.name for f in ps_args.enabled_features(args)] == ["compile-transformer-layers"]


def failures(argv, phase="layout", world_size=1):
    args = parse(argv, world_size) if phase == "layout" else validated(argv, world_size)
    try:
        ps_args.validate(args, phase)
    except ps_args.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


@pytest.mark.parametrize("extra, fragment", [
    (("--compile-transformer-layers-mode", "max-autotune-no-cudagraphs"), "only act with --compile-transformer-layers"),
    (("--compile-transformer-layers", "--compile-transformer-layers-mode", "reduce-overhead"), "CUDA graph trees"),
    (("--compile-transformer-layers", "--compile-transformer-layers-mode", "max-autotune"), "CUDA graph trees"),
    (COMPILED + ("--compile-transformer-layers-mode", "max-autotune-no-cudagraphs"), "is an inductor mode"),
    (("--compile-transformer-layers", "--compile-transformer-layers-warmup-iters", "0"), "at least 1"),
])
def test_options_rule(extra, fragment):
    problems = failures(tiny_argv(*extra))
    assert fragment in problems["compile-transformer-layers-options"]


@pytest.mark.parametrize("extra, rule_name, fragment", [
    (("--cuda-graph-impl", "transformer_engine"), "compile-transformer-layers-not-cuda-graphed", "--cuda-graph-impl transformer_engine"),
    (("--cuda-graph-impl", "local"), "compile-transformer-layers-not-cuda-graphed", "--cuda-graph-impl local"),
    (("--overlap-moe-expert-parallel-comm",), "compile-transformer-layers-not-cuda-graphed", "would never run"),
    (("--use-distributed-optimizer", "--overlap-param-gather"), "compile-transformer-layers-hooks", "--overlap-param-gather"),
    (("--use-megatron-fsdp", "--megatron-fsdp-enable-fine-grained-param-gather"), "compile-transformer-layers-hooks", "fine-grained"),
    (("--nvtx-ranges",), "compile-transformer-layers-hooks", "--nvtx-ranges"),
])
def test_refused_combinations(extra, rule_name, fragment):
    problems = failures(tiny_argv("--compile-transformer-layers", *extra))
    assert fragment in problems[rule_name]
    # The same flags without compilation are none of this rule's business.
    assert rule_name not in failures(tiny_argv(*extra))


def test_megatron_fsdp_param_gather_is_fine():
    problems = failures(tiny_argv("--compile-transformer-layers", "--use-megatron-fsdp", "--overlap-param-gather"))
    assert "compile-transformer-layers-hooks" not in problems


@pytest.mark.parametrize("recompute, refused", [
    (("--recompute-granularity", "selective"), "core_attn"),
    (("--recompute-granularity", "selective", "--recompute-modules", "moe"), "moe"),
    (("--recompute-granularity", "selective", "--recompute-modules", "moe_act"), None),
    (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"), None),
])
def test_recompute_rule(recompute, refused):
    problems = failures(tiny_argv("--compile-transformer-layers", "--no-gradient-accumulation-fusion", *recompute),
                        phase="combination")
    message = problems.get("compile-transformer-layers-recompute")
    if refused is None:
        assert message is None
    else:
        assert f"{refused} checkpoint inside the compiled layer" in message


def test_patches_registered_and_wanted_only_with_flag():
    by_name = {p.name: p for p in patches.registered()}
    for name in ps_compile.PATCH_NAMES:
        patch = by_name[name]
        assert patch.kind == "feature" and patch.flags == ("--compile-transformer-layers",)
        assert patch.reason and "\n" not in patch.reason
    assert {t for t, *_ in ps_compile.EAGER_REGIONS.values()} == {
        f"megatron.core.transformer.moe.moe_layer.{f}" for f in REGION_FUNCTIONS}
    off, on = parse(tiny_argv()), parse(tiny_argv("--compile-transformer-layers"))
    assert not {p.name for p in patches.wanted(off)} & set(ps_compile.PATCH_NAMES)
    assert set(ps_compile.PATCH_NAMES) <= {p.name for p in patches.wanted(on)}


def test_unpatched_upstream_mode_refuses_the_flag(monkeypatch):
    monkeypatch.setenv("MEGATRON_PATCHSET", "off")
    with pytest.raises(patches.PatchsetError, match="--compile-transformer-layers"):
        patches.apply(parse(tiny_argv("--compile-transformer-layers")))
    assert not set(patches.applied()) & set(ps_compile.PATCH_NAMES)


def test_compiling_without_the_patches_is_an_error():
    import torch

    with pytest.raises(patches.PatchsetError, match="not applied"):
        ps_compile.compile_transformer_layers([torch.nn.Linear(1, 1)], ps_compile.CompileOptions())


def test_monitor_times_warmup_then_turns_strict(monkeypatch):
    import torch

    iteration = {"now": None}
    monitor = ps_compile.CompileMonitor(2, iteration=lambda: iteration["now"])
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


# ---------------------------------------------------------------------------------------
# The model: what gets compiled, and real compiled training on the CPU
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mocked_compile_records_every_transformer_layer(tmp_path):
    (rec,) = train(tmp_path, 1, "--compile-transformer-layers", mode="mock", steps=1)
    assert rec["error"] is None
    # The four TransformerLayers (each a MoE layer here) and nothing else, with the options.
    assert rec["compiled_calls"] == [{"owner": "TransformerLayer", "kwargs": {"backend": "inductor"}}] * 4
    assert rec["compiled_forwards"] == [f"decoder.layers.{i}" for i in range(4)]
    assert set(ps_compile.PATCH_NAMES) <= set(rec["applied"])
    assert rec["eager_regions"] == {name: True for name in ps_compile.EAGER_REGIONS}
    assert rec["dtoh_points"] == ["before_ep_alltoall"]


@pytest.mark.slow
def test_compiled_training_matches_eager_with_breaks_only_at_eager_regions(tmp_path):
    (eager,) = train(tmp_path / "eager", 1)
    (compiled,) = train(tmp_path / "compiled", 1, *COMPILED)
    assert eager["error"] is None and compiled["error"] is None
    assert eager["compiled_forwards"] == [] and len(compiled["compiled_forwards"]) == 4
    # Same arithmetic (fp32, aot_eager): first-step gradients of every parameter, the router's
    # with the aux-loss gradient scaled at backward time, and six steps of losses.
    assert compiled["grad_norms"].keys() == eager["grad_norms"].keys()
    for name, norm in eager["grad_norms"].items():
        assert compiled["grad_norms"][name] == pytest.approx(norm, rel=1e-4, abs=1e-7), name
    # Later steps: fp32 rounding drifts under Adam at lr 1e-2 (< 1%); a stale aux-loss scale (the
    # schedule sets a different one every step here) was off by 10-30%.
    for mine, theirs in zip(compiled["router_grads"], eager["router_grads"]):
        assert mine == pytest.approx(theirs, rel=2e-2)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    # Graph breaks: only the three compile-disabled MoE regions.
    stats = compiled["stats"]
    assert break_sites(stats[-1]) == set(REGION_FUNCTIONS)
    assert stats[-1]["graphs"] > 0 and stats[-1]["frames_ok"] == stats[-1]["frames"]
    # Warm-up: one-time guards recompile in iteration 2 at most; nothing after it.
    assert all(s == stats[1] for s in stats[2:])
    print(f"\ncompiled tiny MoE (4 layers, aot_eager): {stats[-1]['graphs']} graphs, "
          f"{stats[-1]['graph_breaks']} graph breaks at {sorted(break_sites(stats[-1]))}, "
          f"{stats[-1]['frames']} frames")


@pytest.mark.slow
def test_force_load_balancing_keeps_the_moe_body_compiled(tmp_path):
    """--moe-router-force-load-balancing with megatron's real RNG-tracker fork: the random logits
    are drawn in the fork's custom op, so the MoE body stays compiled (its breaks are the three
    eager regions it calls; without the op dynamo gave up on MoELayer.custom_forward and those
    breaks were gone) and every frame compiles; the draws and the losses equal eager's."""
    flb = ("--moe-router-force-load-balancing", "--attention-dropout", "0", "--hidden-dropout", "0")
    (eager,) = train(tmp_path / "eager", 1, *flb, mode="real-fork", steps=4)
    (compiled,) = train(tmp_path / "compiled", 1, *flb, *COMPILED, mode="real-fork", steps=4)
    assert eager["error"] is None and compiled["error"] is None
    assert "compile.random_logits_opaque" in compiled["applied"]
    stats = compiled["stats"][-1]
    assert set(REGION_FUNCTIONS) <= break_sites(stats), break_sites(stats)
    assert stats["frames_ok"] == stats["frames"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    print(f"\nforce load balancing, real fork: {stats['graphs']} graphs, {stats['graph_breaks']} breaks at "
          f"{sorted(break_sites(stats))}, {stats['frames_ok']} of {stats['frames']} frames")


def test_random_logits_op_draws_what_upstream_draws(monkeypatch):
    """The op's numbers equal upstream RandomSTE's from the same tracker state; the gradient
    passes straight through; the tracker's stream advances as upstream's does."""
    import torch
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.moe_utils import RandomSTE

    monkeypatch.setattr(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    tracker = tp_random.get_cuda_rng_tracker()
    name = tp_random.get_expert_parallel_rng_tracker_name()
    monkeypatch.setattr(tracker, "states_", {name: torch.Generator().manual_seed(7).get_state()})
    op = ps_compile.random_logits_op()
    logits = torch.randn(5, 8, requires_grad=True)
    saved = tracker.states_[name]
    ours = [op(logits), op(logits)]
    tracker.states_[name] = saved
    theirs = [RandomSTE.apply(logits), RandomSTE.apply(logits)]
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], ours[1])  # the stream advanced between the two draws
    ours[0].sum().backward()
    assert torch.equal(logits.grad, torch.ones_like(logits))


def test_force_biased_is_refused_with_compile():
    from tests.unit.test_rules import failures

    got = failures(tiny_argv("--compile-transformer-layers", "--moe-router-force-biased", "0.5"))
    assert "--moe-router-force-biased 0.5" in got["compile-transformer-layers-router-force-biased"]
    assert "compile-transformer-layers-router-force-biased" not in failures(
        tiny_argv("--compile-transformer-layers", "--moe-router-force-load-balancing"))


def test_random_logits_patch_only_with_force_load_balancing():
    patch = patches.get("compile.random_logits_opaque")
    assert patch.wanted(parse(tiny_argv("--compile-transformer-layers", "--moe-router-force-load-balancing")))
    assert not patch.wanted(parse(tiny_argv("--compile-transformer-layers")))
    assert not patch.wanted(parse(tiny_argv("--moe-router-force-load-balancing")))


@pytest.mark.slow
def test_recompile_after_warmup_is_an_error(tmp_path):
    (rec,) = train(tmp_path, 1, *COMPILED, mode="strict")
    # Iterations 1-2 warm up, 3-4 run the compiled code, the shorter sequence of 5 must recompile.
    assert len(rec["losses"]) == 4
    assert "fail_on_recompile" in rec["error"] and "transformer_layer.py" in rec["error"]


@pytest.mark.slow
def test_compiled_two_processes_expert_parallel(tmp_path):
    recs = train(tmp_path, 2, "--expert-model-parallel-size", "2", *COMPILED)
    for rec in recs:
        assert rec["error"] is None
        assert all(math.isfinite(x) for x in rec["losses"])
        assert rec["losses"][-1] < rec["losses"][0] - 1.0
        assert break_sites(rec["stats"][-1]) == set(REGION_FUNCTIONS)
        assert all(s == rec["stats"][1] for s in rec["stats"][2:])


@pytest.mark.parametrize("knobs", [{}, {"FSDP": "1"}, {"COMPILE": "0"}])
def test_example_script_dry_run(knobs):
    from tests.unit.conftest import dry_run_example

    proc = dry_run_example(os.path.join("examples", "pretrain_moe_compile.sh"), NGPUS="2", **knobs)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "dry-run: OK" in proc.stdout
    features = next(line for line in proc.stdout.splitlines() if line.startswith("fork features enabled"))
    assert ("compile-transformer-layers" in features) == (knobs.get("COMPILE") != "0")


def test_aux_loss_grad_op_keeps_the_loss_shape():
    """The schedule sets a shape-[1] loss scale; the op's gradient must have the aux loss's own
    shape (its fake tensor says so and inductor asserts it: a 0-d loss got a [1] gradient on the
    first GPU run)."""
    import torch

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.patchset import compile as ps_compile

    op = ps_compile.aux_loss_grad_op()
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 0.25)
        scalar = op(torch.tensor(3.0), torch.tensor(1.0))
        assert scalar.shape == () and scalar.item() == 0.25
        vector = op(torch.ones(4), torch.tensor(1.0))
        assert vector.shape == (4,) and torch.equal(vector, torch.full((4,), 0.25))
        torch.library.opcheck(op, (torch.tensor(3.0), torch.tensor(1.0)))
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def test_aux_loss_backward_compiles_with_inductor_on_cpu():
    """Inductor checks the custom op's real output against its fake (the check that failed on
    the first GPU run, reproduced here on the CPU): compiled forward+backward through megatron's
    aux-loss scaler with the schedule's shape-[1] scale gives eager's gradients."""
    import torch

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.patchset import patches

    names = patches.apply_patches([patches.get("compile.aux_loss_backward_opaque")])
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 0.5)

        def step(x, w):
            h = x @ w
            aux = (h.float() ** 2).mean()
            return MoEAuxLossAutoScaler.apply(h, aux).sum()

        x, w = torch.randn(8, 4), torch.randn(4, 4, requires_grad=True)
        torch.compile(step, backend="inductor")(x, w).backward()
        compiled = w.grad.clone()
        w.grad = None
        step(x, w).backward()
        torch.testing.assert_close(compiled, w.grad)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
        patches.revert(names)


@pytest.mark.slow
def test_compiled_with_inductor_trains_like_eager(tmp_path):
    """The GPU backend (inductor, generating C++ on the CPU) end to end on the tiny MoE: it
    compiles, breaks only at the eager regions, and six losses stay within fp32 reordering of
    eager's (about 80 s on two cores)."""
    # No dropout: inductor draws its own random numbers, so dropout masks would differ from eager's.
    no_dropout = ("--attention-dropout", "0", "--hidden-dropout", "0")
    (eager,) = train(tmp_path / "eager", 1, *no_dropout)
    (compiled,) = train(tmp_path / "inductor", 1, *no_dropout, "--compile-transformer-layers",
                        "--compile-transformer-layers-backend", "inductor")
    assert compiled["error"] is None, compiled["error"]
    assert len(compiled["compiled_forwards"]) == 4
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    assert break_sites(compiled["stats"][-1]) == set(REGION_FUNCTIONS)
    assert all(s == compiled["stats"][1] for s in compiled["stats"][2:])
