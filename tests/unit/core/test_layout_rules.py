"""The core's layout rules (megatron's own flags against the world size, data, tokenizer, schedule),
one test per rule, with megatron's real parser; every rule of the table has a test."""

import pytest

from megatron.patchset.core import argsfile, flags, rules
from tests.unit.conftest import failures, parse, tiny_argv


def test_tiny_config_is_valid_on_one_and_two_gpus():
    assert failures(tiny_argv(), 1) == {}
    assert failures(tiny_argv("--expert-model-parallel-size", "2"), 2) == {}


def test_every_rule_has_a_test_here():
    import glob
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/unit
    paths = sorted(glob.glob(os.path.join(here, "**", "test_*.py"), recursive=True))
    source = "".join(open(path).read() for path in paths)
    for rule in rules._RULES:
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
    got = failures(
        tiny_argv("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"), 2
    )
    assert "--expert-tensor-parallel-size 2" in got["expert-parallel-divides-world-size"]


def test_experts_divisible_by_expert_parallel():
    got = failures(tiny_argv("--expert-model-parallel-size", "3"), 3)
    assert "--num-experts 8" in got["experts-divisible-by-expert-parallel"]
    assert "--expert-model-parallel-size 3" in got["experts-divisible-by-expert-parallel"]


def test_expert_parallel_needs_experts():
    argv = [a for a in tiny_argv() if a not in ("--moe-grouped-gemm",)]

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
    uneven = tiny_argv(
        "--pipeline-model-parallel-size",
        "3",
        "--global-batch-size",
        "12",
        "--decoder-first-pipeline-num-layers",
        "2",
    )
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
    assert {
        "expert-parallel-divides-world-size",
        "experts-divisible-by-expert-parallel",
        "global-batch-divisible",
    } <= set(got)


def test_rules_do_not_modify_arguments():
    args = parse(tiny_argv("--expert-model-parallel-size", "3"), 2)
    before = dict(vars(args))
    with pytest.raises(rules.PatchsetArgumentError):
        rules.validate(args, "layout")
    assert vars(args) == before


def test_flags_have_help_and_kebab_case():
    import argparse

    parser = flags.add_patchset_args(argparse.ArgumentParser())
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert option == option.lower() and "_" not in option, option
                assert action.help and len(action.help) > 20, option


def test_eval_interval_set():

    argv = argsfile.remove(tiny_argv(), "--eval-interval")
    assert "--eval-interval is not set" in failures(argv, 1)["eval-interval-set"]
    assert "eval-interval-set" not in failures(tiny_argv(), 1)


def test_lr_warmup_shorter_than_decay():
    got = failures(tiny_argv("--train-iters", "5", "--lr-warmup-iters", "5"), 1)
    assert "--lr-warmup-iters 5" in got["lr-warmup-shorter-than-decay"]
    assert "--train-iters" in got["lr-warmup-shorter-than-decay"]
    got = failures(tiny_argv("--lr-decay-iters", "4"), 1)
    assert "--lr-decay-iters" in got["lr-warmup-shorter-than-decay"]
    assert "lr-warmup-shorter-than-decay" not in failures(
        tiny_argv("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "0"), 1
    )
