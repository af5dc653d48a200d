"""The core's layout rules (megatron's own flags against the world size, data, tokenizer, schedule),
one test per rule, with megatron's real parser; every rule of the table has a test."""

import pytest

from megatron.patchset.core import argsfile, flags, rules
from tests.unit.conftest import combination_failures, failures, parse, tiny_argv


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


# --- sizes, shapes, precision ---


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--pipeline-model-parallel-size", "0"),
        ("--expert-model-parallel-size", "0"),
        ("--context-parallel-size", "0"),
        ("--micro-batch-size", "0"),
        ("--global-batch-size", "0"),
        ("--num-attention-heads", "0"),
        ("--num-layers", "0"),
        ("--expert-tensor-parallel-size", "0"),
        ("--seq-length", "0"),
        ("--tensor-model-parallel-size", "-1"),
        ("--vocab-size", "-5"),
        ("--hidden-size", "-8"),
        ("--num-query-groups", "0"),
        ("--moe-router-topk", "0"),
    ],
)
def test_sizes_positive_gates_the_rules_that_divide(flag, value):
    got = failures(tiny_argv(flag, value), 2)
    assert list(got) == ["sizes-positive"], got  # the gate stops the rules that would divide
    assert f"{flag} {value} (" in got["sizes-positive"]


def test_sizes_positive_names_the_world_size_source():
    args = parse(tiny_argv("--dry-run-world-size", "0"))
    args.world_size = args.dry_run_world_size
    with pytest.raises(rules.PatchsetArgumentError) as err:
        rules.validate(args, "layout")
    assert "--dry-run-world-size 0 (the number of GPUs" in str(err.value)
    args = parse(tiny_argv())
    args.world_size = -2
    with pytest.raises(rules.PatchsetArgumentError, match="WORLD_SIZE=-2"):
        rules.validate(args, "layout")


def test_a_rule_that_cannot_evaluate_its_flags_reports_them():
    args = parse(tiny_argv())
    args.num_layers = "four"  # a value no parser would give: the rule's arithmetic fails
    args.pipeline_model_parallel_size = 2
    with pytest.raises(rules.PatchsetArgumentError) as err:
        rules.validate(args, "layout")
    text = str(err.value)
    assert "[sizes-positive] the values of --tensor-model-parallel-size" in text
    assert "--num-layers" in text and "could not be checked (TypeError" in text


def test_attention_heads_fit_hidden_size():
    got = failures(tiny_argv("--hidden-size", "250"))
    assert (
        "--hidden-size 250 is not a multiple of --num-attention-heads 8"
        in got["attention-heads-fit-hidden-size"]
    )
    assert "attention-heads-fit-hidden-size" not in failures(
        tiny_argv("--hidden-size", "250", "--kv-channels", "32")
    )
    got = failures(tiny_argv("--num-query-groups", "3"))
    assert "--num-query-groups 3 does not divide" in got["attention-heads-fit-hidden-size"]


@pytest.mark.parametrize("extra", [("--moe-router-topk", "9"), ("--num-experts", "1")])
def test_moe_router_topk_fits_experts(extra):
    got = failures(tiny_argv(*extra))
    assert "--moe-router-topk" in got["moe-router-topk-fits-experts"]
    assert "--num-experts" in got["moe-router-topk-fits-experts"]


def test_one_precision():
    got = failures(tiny_argv("--fp16"))
    assert "--fp16 and --bf16 are both set" in got["one-precision"]


# --- data files and tokenizer ---


def data_argv(*data):
    return argsfile.remove(tiny_argv(), "--mock-data") + ["--data-path", *data]


def test_data_files_accept_a_prefix_and_a_weighted_blend(tmp_path):
    from tests.unit.support.indexed_data import write_dataset

    a = write_dataset(tmp_path / "a")
    b = write_dataset(tmp_path / "b", seed=1)
    assert failures(data_argv(a)) == {}
    assert failures(data_argv("0.3", a, "0.7", b)) == {}
    assert failures(data_argv(a, b)) == {}


def test_data_files_name_what_is_wrong(tmp_path):
    from tests.unit.support.indexed_data import write_dataset

    good = write_dataset(tmp_path / "good")
    (tmp_path / "garbage.bin").write_bytes(b"\0" * 64)
    (tmp_path / "garbage.idx").write_bytes(b"not an index")
    cases = {
        str(tmp_path / "missing"): "missing.bin and "
        + str(tmp_path / "missing")
        + ".idx not found",
        str(tmp_path): "is a directory: give the prefix of a <prefix>.bin/<prefix>.idx pair (e.g.",
        str(tmp_path / "garbage"): "garbage.idx is not a megatron indexed dataset index",
        good + ".bin": f"give the prefix without .bin ({good})",
    }
    for prefix, expected in cases.items():
        got = failures(data_argv(prefix))
        assert expected in got["data-files"], (prefix, got)
    got = failures(data_argv("0.3", good, "O.7", good))  # a typo in a weight
    assert "'O.7' is not a weight" in got["data-files"]
    got = failures(data_argv("0.3", good, good))
    assert "'0.3' reads as a weight" in got["data-files"]


def test_data_and_tokenizer_refuses_two_data_sources(tmp_path):
    from tests.unit.support.indexed_data import write_dataset

    got = failures(tiny_argv("--data-path", write_dataset(tmp_path / "a")))
    assert "--mock-data and --data-path are two data sources" in got["data-and-tokenizer"]


def test_data_files_of_the_other_data_flags(tmp_path):
    from tests.unit.support.indexed_data import write_dataset

    good = write_dataset(tmp_path / "good")
    base = argsfile.remove(tiny_argv(), "--mock-data")
    got = failures(
        base
        + [
            "--train-data-path",
            good,
            "--valid-data-path",
            str(tmp_path / "x"),
            "--test-data-path",
            good,
        ]
    )
    assert "--valid-data-path" in got["data-files"] and "x.bin" in got["data-files"]
    args_file = tmp_path / "data.txt"
    args_file.write_text(f"0.5 {good} 0.5 {tmp_path / 'y'}\n")
    got = failures(base + ["--data-args-path", str(args_file)])
    assert f"--data-args-path {args_file}" in got["data-files"] and "y.bin" in got["data-files"]
    got = failures(base + ["--data-args-path", str(tmp_path / "none.txt")])
    assert "none.txt: no such file" in got["data-files"]
    split_file = tmp_path / "splits.json"
    split_file.write_text(f'{{"train": "{good}", "valid": ["{good}"]}}')
    got = failures(base + ["--per-split-data-args-path", str(split_file)])
    assert "not a JSON object with train, valid and test lists" in got["data-files"]


def test_tokenizer_files(tmp_path):
    base = argsfile.remove(argsfile.remove(tiny_argv(), "--tokenizer-type"), "--vocab-size")
    missing = str(tmp_path / "tok.model")
    got = failures(
        base + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", missing]
    )
    assert f"--tokenizer-model {missing}: no such file" in got["tokenizer-files"]
    hub = base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "Qwen/Qwen3-8B"]
    assert "tokenizer-files" not in failures(hub)  # a hub id is loaded at launch
    local = base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "./no/such"]
    assert "./no/such: no such file" in failures(local)["tokenizer-files"]


def test_data_token_ids_within_vocabulary(tmp_path):
    from tests.unit.support.indexed_data import write_dataset

    small = write_dataset(tmp_path / "small", vocab=4096)
    large = write_dataset(tmp_path / "large", vocab=4096, top_token=50000)
    ok = combination_failures(data_argv(small), 1)
    assert "data-token-ids-within-vocabulary" not in ok, ok
    got = combination_failures(data_argv(large), 1)
    assert "holds token id 50000, but the vocabulary has" in got["data-token-ids-within-vocabulary"]
    assert "--vocab-size 4096" in got["data-token-ids-within-vocabulary"]


def test_save_needs_save_interval(tmp_path):
    got = failures(tiny_argv("--save", str(tmp_path)))
    assert f"--save {tmp_path} needs --save-interval" in got["save-needs-save-interval"]
    assert "save-needs-save-interval" not in failures(
        tiny_argv("--save", str(tmp_path), "--save-interval", "10")
    )


def test_optimizer_graph_needs_one_norm_group():
    """EP 2 without the distributed optimizer: two norm groups summed on the host, refused under
    --optimizer-cuda-graph; the distributed optimizer or EP 1 is accepted."""
    graph = ("--optimizer-cuda-graph", "--expert-model-parallel-size", "2")
    got = failures(tiny_argv(*graph), 2)
    message = got["optimizer-graph-needs-one-norm-group"]
    assert "--expert-model-parallel-size 2" in message and "--use-distributed-optimizer" in message
    name = "optimizer-graph-needs-one-norm-group"
    assert name not in failures(tiny_argv(*graph, "--use-distributed-optimizer"), 2)
    assert name not in failures(tiny_argv("--optimizer-cuda-graph"), 1)
    assert name not in failures(tiny_argv("--expert-model-parallel-size", "2"), 2)


def test_the_optimizer_graph_refuses_flags_whose_step_reads_the_host():
    """--log-num-zeros-in-grad and --fp16 make megatron's optimizer step read a value back to
    the host (count_zeros_fp32, found_inf), which --optimizer-cuda-graph cannot capture: the rule
    names the flag and what it reads; either flag alone, or the graph alone, is accepted."""
    name = "optimizer-graph-host-reads"
    got = failures(tiny_argv("--optimizer-cuda-graph", "--log-num-zeros-in-grad"), 1)
    assert "--log-num-zeros-in-grad (the count of zero gradients)" in got[name]
    assert "Drop --log-num-zeros-in-grad or --optimizer-cuda-graph" in got[name]
    fp16 = argsfile.remove(tiny_argv("--optimizer-cuda-graph", "--fp16"), "--bf16")
    assert "--fp16 (the loss scaler's inf/nan check)" in failures(fp16, 1)[name]
    assert name not in failures(tiny_argv("--log-num-zeros-in-grad"), 1)
    assert name not in failures(tiny_argv("--optimizer-cuda-graph"), 1)
