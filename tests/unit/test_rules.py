"""The fork's validation rules, one test per rule, with megatron's real parser."""

import pytest

from megatron.patchset import arguments as ps_args
from tests.unit.conftest import parse, tiny_argv


def failures(argv, world_size=1, phase="layout", config=None):
    args = parse(argv, world_size)
    try:
        ps_args.validate(args, phase, config=config)
    except ps_args.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


def test_tiny_config_is_valid_on_one_and_two_gpus():
    assert failures(tiny_argv(), 1) == {}
    assert failures(tiny_argv("--expert-model-parallel-size", "2"), 2) == {}


def test_every_rule_has_a_test_here():
    import glob
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    source = "".join(open(path).read() for path in sorted(glob.glob(os.path.join(here, "test_*.py"))))
    for rule in ps_args.RULES:
        assert f'"{rule.name}"' in source, f"rule {rule.name} has no test under tests/unit"


def test_model_parallel_divides_world_size():
    got = failures(tiny_argv("--tensor-model-parallel-size", "2", "--global-batch-size", "12"), 3)
    assert "--tensor-model-parallel-size 2" in got["model-parallel-divides-world-size"]
    assert "world size 3" in got["model-parallel-divides-world-size"]


def test_expert_parallel_divides_world_size_names_the_flag():
    # 6 experts so that megatron's own num_experts % EP check would pass: it catches this only
    # at process-group creation, with a message that does not name the flag.
    got = failures(tiny_argv("--num-experts", "6", "--expert-model-parallel-size", "3"), 2)
    assert set(got) == {"expert-parallel-divides-world-size"}
    assert "--expert-model-parallel-size 3" in got["expert-parallel-divides-world-size"]
    assert "world size 2" in got["expert-parallel-divides-world-size"]


def test_expert_parallel_counts_expert_tensor_parallel():
    got = failures(tiny_argv("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"), 2)
    assert "--expert-tensor-parallel-size 2" in got["expert-parallel-divides-world-size"]


def test_experts_divisible_by_expert_parallel():
    got = failures(tiny_argv("--expert-model-parallel-size", "3"), 3)
    assert "--num-experts 8" in got["experts-divisible-by-expert-parallel"]
    assert "--expert-model-parallel-size 3" in got["experts-divisible-by-expert-parallel"]


def test_expert_parallel_needs_experts():
    argv = [a for a in tiny_argv() if a not in ("--moe-grouped-gemm",)]
    from megatron.patchset import argsfile

    argv = argsfile.remove(argv, "--num-experts")
    got = failures(argv + ["--expert-model-parallel-size", "2"], 2)
    assert "set --num-experts" in got["experts-divisible-by-expert-parallel"]


def test_heads_divisible_by_tensor_parallel():
    got = failures(tiny_argv("--tensor-model-parallel-size", "4"), 4)
    assert "--num-query-groups 2" in got["heads-divisible-by-tensor-parallel"]
    got = failures(tiny_argv("--tensor-model-parallel-size", "3", "--global-batch-size", "12"), 3)
    assert "--num-attention-heads 8" in got["heads-divisible-by-tensor-parallel"]


def test_layers_divisible_by_pipeline():
    got = failures(tiny_argv("--pipeline-model-parallel-size", "3", "--global-batch-size", "12"), 3)
    assert "--num-layers 4" in got["layers-divisible-by-pipeline"]
    uneven = tiny_argv("--pipeline-model-parallel-size", "3", "--global-batch-size", "12",
                       "--decoder-first-pipeline-num-layers", "2")
    assert "layers-divisible-by-pipeline" not in failures(uneven, 3)


def test_global_batch_divisible():
    got = failures(tiny_argv("--global-batch-size", "12"), 2)
    assert "--global-batch-size 12" in got["global-batch-divisible"]
    assert "data-parallel size 2" in got["global-batch-divisible"]


@pytest.mark.parametrize("flag", ["--sft", "--dataloader-inter-document-masking"])
def test_pretrain_gpt_data_scope(flag):
    got = failures(tiny_argv(flag), 1)
    assert flag in got["pretrain-gpt-data-scope"]


def test_data_and_tokenizer(tmp_path):
    from megatron.patchset import argsfile

    no_data = argsfile.remove(tiny_argv(), "--mock-data")
    assert "--mock-data or --data-path" in failures(no_data, 1)["data-and-tokenizer"]
    no_vocab = argsfile.remove(tiny_argv(), "--vocab-size")
    assert "NullTokenizer needs --vocab-size" in failures(no_vocab, 1)["data-and-tokenizer"]
    gpt2 = argsfile.override(tiny_argv(), "--tokenizer-type", "GPT2BPETokenizer")
    msg = failures(gpt2, 1)["data-and-tokenizer"]
    assert "needs --vocab-file" in msg and "needs --merge-file" in msg
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    gpt2_files = gpt2 + ["--vocab-file", str(vocab), "--merge-file", str(tmp_path / "missing.txt")]
    msg = failures(gpt2_files, 1)["data-and-tokenizer"]
    assert "missing.txt does not exist" in msg and "vocab-file" not in msg


def test_all_failures_reported_together():
    got = failures(tiny_argv("--expert-model-parallel-size", "3", "--global-batch-size", "10"), 2)
    assert {"expert-parallel-divides-world-size", "experts-divisible-by-expert-parallel",
            "global-batch-divisible"} <= set(got)


def test_rules_do_not_modify_arguments():
    args = parse(tiny_argv("--expert-model-parallel-size", "3"), 2)
    before = dict(vars(args))
    with pytest.raises(ps_args.PatchsetArgumentError):
        ps_args.validate(args, "layout")
    assert vars(args) == before


def test_flags_have_help_and_kebab_case():
    import argparse

    parser = ps_args.add_patchset_args(argparse.ArgumentParser())
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert option == option.lower() and "_" not in option, option
                assert action.help and len(action.help) > 20, option


# --- P2P backward overlap (megatron/patchset/schedule_plan.py) ---

# PP=2 x VPP=2 x EP=2 on 4 GPUs, 2 layers per model chunk: where the P2P-overlap flags act.
P2P_LAYOUT = ("--num-layers", "8", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "2", "--expert-model-parallel-size", "2",
              "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--global-batch-size", "64")
P2P_FLAGS = ("--overlap-p2p-backward-on-comm-stream", "--overlap-p2p-wgrad-delayed-layer-number", "2",
             "--overlap-p2p-with-transformer-layer-wgrad")


def p2p_argv(*extra, flags=P2P_FLAGS):
    return tiny_argv(*P2P_LAYOUT, *flags, *extra)


def combination_failures(argv, world_size):
    """Combination-phase failures after megatron's validate_args and TransformerConfig, as
    pretrain_gpt.py runs them (device queries answered as on the target GPU)."""
    import contextlib
    import io

    from megatron.patchset.dry_run import target_device
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    args = parse(argv, world_size)
    args.rank = 0
    with target_device(), contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
        config = core_transformer_config_from_args(args)
    try:
        ps_args.validate(args, "combination", config=config)
    except ps_args.PatchsetArgumentError as exc:
        return {rule.name: message for rule, message in exc.failures}
    return {}


def test_p2p_overlap_layout_is_valid():
    assert failures(p2p_argv(), 4) == {}
    assert combination_failures(p2p_argv(), 4) == {}


def test_p2p_overlap_needs_ep_overlap_and_delayed_wgrad():
    from megatron.patchset import argsfile

    argv = argsfile.remove(p2p_argv(), "--delay-wgrad-compute")
    msg = failures(argv, 4)["p2p-overlap-needs-ep-overlap-and-delayed-wgrad"]
    assert "need --delay-wgrad-compute" in msg and "--overlap-p2p-backward-on-comm-stream" in msg
    argv = argsfile.remove(argv, "--overlap-moe-expert-parallel-comm")
    msg = failures(argv, 4)["p2p-overlap-needs-ep-overlap-and-delayed-wgrad"]
    assert "--overlap-moe-expert-parallel-comm and --delay-wgrad-compute" in msg
    # Only the fork's flags are checked: default values ask for nothing.
    assert "p2p-overlap-needs-ep-overlap-and-delayed-wgrad" not in failures(tiny_argv(), 1)


def test_p2p_overlap_needs_interleaved_pipeline():
    two_gpus = tiny_argv("--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm",
                         "--delay-wgrad-compute", "--overlap-p2p-wgrad-delayed-layer-number", "2")
    msg = failures(two_gpus, 2)["p2p-overlap-needs-interleaved-pipeline"]
    assert "--overlap-p2p-wgrad-delayed-layer-number 2" in msg
    assert "--pipeline-model-parallel-size 1" in msg and "no virtual pipeline" in msg
    from megatron.patchset import argsfile

    no_vpp = argsfile.remove(p2p_argv(), "--num-layers-per-virtual-pipeline-stage")
    msg = failures(no_vpp, 4)["p2p-overlap-needs-interleaved-pipeline"]
    assert "--num-layers-per-virtual-pipeline-stage" in msg and "--pipeline-model-parallel-size" not in msg
    one_chunk = p2p_argv("--num-layers-per-virtual-pipeline-stage", "4")  # 4 layers per rank: 1 chunk
    assert "no virtual pipeline" in failures(one_chunk, 4)["p2p-overlap-needs-interleaved-pipeline"]
    msg = failures(p2p_argv("--no-overlap-p2p-communication"), 4)["p2p-overlap-needs-interleaved-pipeline"]
    assert "--no-overlap-p2p-communication" in msg
    stages = p2p_argv("--num-virtual-stages-per-pipeline-rank", "2")
    stages = argsfile.remove(stages, "--num-layers-per-virtual-pipeline-stage")
    assert "p2p-overlap-needs-interleaved-pipeline" not in failures(stages, 4)


P2P_UNSUPPORTED = [
    (("--expert-model-parallel-size", "1"), "--expert-model-parallel-size 1"),
    (("--moe-token-dispatcher-type", "allgather"), "--moe-token-dispatcher-type allgather"),
    (("--recompute-granularity", "full"), "--recompute-granularity full"),
    (("--recompute-method", "uniform"), "--recompute-method uniform"),
    (("--recompute-num-layers", "1"), "--recompute-num-layers 1"),
    (("--recompute-modules", "moe"), "--recompute-modules with moe"),
    (("--moe-shared-expert-overlap",), "--moe-shared-expert-overlap"),
    (("--mtp-num-layers", "2"), "--mtp-num-layers 2"),
    (("--cuda-graph-impl", "transformer_engine"), "whole layers"),
    (("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"), "--cuda-graph-modules moe"),
    (("--transformer-impl", "local"), "--transformer-impl local"),
    (("--overlap-dispatch-backward-with-experts-wgrad",), "--overlap-dispatch-backward-with-experts-wgrad"),
    (("--use-megatron-fsdp",), "--use-megatron-fsdp"),
]


@pytest.mark.parametrize("extra, named", P2P_UNSUPPORTED, ids=[n for _, n in P2P_UNSUPPORTED])
def test_p2p_overlap_fine_grained_schedule_limits(extra, named):
    msg = failures(p2p_argv(*extra), 4)["p2p-overlap-fine-grained-schedule-limits"]
    assert named in msg and "fine-grained 1F1B schedule" in msg
    # megatron checks these itself (late, or without naming a flag) when the fork's flags are off.
    assert "p2p-overlap-fine-grained-schedule-limits" not in failures(p2p_argv(*extra, flags=()), 4)


def test_p2p_overlap_fine_grained_schedule_limits_precision_and_torch(monkeypatch):
    from megatron.core import utils as mcore_utils
    from megatron.patchset import argsfile

    msg = failures(argsfile.remove(p2p_argv(), "--bf16"), 4)["p2p-overlap-fine-grained-schedule-limits"]
    assert "add --bf16 or --fp16" in msg
    monkeypatch.setattr(mcore_utils, "is_torch_min_version", lambda version, *a, **k: version != "2.6.0")
    assert "before torch 2.6.0" in failures(p2p_argv(), 4)["p2p-overlap-fine-grained-schedule-limits"]


def test_p2p_overlap_delayed_layer_number_range():
    got = combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "0")), 4)
    assert "at least 1" in got["p2p-overlap-delayed-layer-number-range"]
    got = combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "3")), 4)
    msg = got["p2p-overlap-delayed-layer-number-range"]
    assert "2 layers per model chunk" in msg and "Use 1 to 2" in msg
    assert combination_failures(p2p_argv(flags=("--overlap-p2p-wgrad-delayed-layer-number", "2")), 4) == {}


def test_p2p_overlap_delayed_layer_number_with_an_uneven_layout():
    from megatron.patchset import argsfile

    argv = argsfile.remove(p2p_argv(), "--num-layers-per-virtual-pipeline-stage")
    argv = argsfile.override(argv, "--num-layers", "6") + ["--pipeline-model-parallel-layout", "Et|tt|tt|tL"]
    assert failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "3"], 4) == {}
    got = combination_failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "3"], 4)
    assert "model chunks of 1, 2 layers" in got["p2p-overlap-delayed-layer-number-range"]
    assert combination_failures(argv + ["--overlap-p2p-wgrad-delayed-layer-number", "2"], 4) == {}


def test_eval_interval_set():
    from megatron.patchset import argsfile

    argv = argsfile.remove(tiny_argv(), "--eval-interval")
    assert "--eval-interval is not set" in failures(argv, 1)["eval-interval-set"]
    assert "eval-interval-set" not in failures(tiny_argv(), 1)


def test_lr_warmup_shorter_than_decay():
    got = failures(tiny_argv("--train-iters", "5", "--lr-warmup-iters", "5"), 1)
    assert "--lr-warmup-iters 5" in got["lr-warmup-shorter-than-decay"]
    assert "--train-iters" in got["lr-warmup-shorter-than-decay"]
    got = failures(tiny_argv("--lr-decay-iters", "4"), 1)
    assert "--lr-decay-iters" in got["lr-warmup-shorter-than-decay"]
    assert "lr-warmup-shorter-than-decay" not in failures(tiny_argv("--lr-warmup-fraction", "0.1",
                                                                     "--lr-warmup-iters", "0"), 1)
