"""Data and tokenizer: what pretrain_gpt.py trains on, the files it reads, and their token ids."""

from __future__ import annotations

import json
import math
import os
import struct

from megatron.patchset.core.rules import listed, rule

# megatron-core 0.19.2's indexed dataset (megatron/core/datasets/indexed_dataset.py): the .idx
# file starts with this header, a little-endian u64 version, a u8 dtype code and u64 sequence and
# document counts; then the sequence lengths (int32), the sequences' byte offsets into the .bin
# (int64) and the document indices (int64).
INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_COUNTS = struct.Struct("<QBQQ")
REMOTE_PREFIXES = ("msc://", "s3://", "gs://", "az://", "http://", "https://")
# Token ids read from each .bin (spread over the file) to compare with the vocabulary.
SAMPLED_TOKENS = 1 << 20


@rule(
    "pretrain-gpt-data-scope",
    phase="layout",
    flags=("--sft", "--dataloader-inter-document-masking"),
)
def _pretrain_scope(args):
    """This pretrain_gpt.py trains on packed pretraining samples (mock or indexed data)."""
    offending = [
        flag
        for flag, on in (
            ("--sft", getattr(args, "sft", False)),
            (
                "--dataloader-inter-document-masking",
                getattr(args, "dataloader_inter_document_masking", False),
            ),
        )
        if on
    ]
    if offending:
        return (
            f"{', '.join(offending)}: variable-length (THD) batches are not supported by "
            "megatron-patchset's pretrain_gpt.py yet; drop the flag."
        )
    return None


_FILE_TOKENIZERS = {
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "BertWordPieceLowerCase": ("--vocab-file",),
    "BertWordPieceCase": ("--vocab-file",),
    "SentencePieceTokenizer": ("--tokenizer-model",),
    "GPTSentencePieceTokenizer": ("--tokenizer-model",),
    "Llama2Tokenizer": ("--tokenizer-model",),
    "TikTokenizer": ("--tokenizer-model",),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
}


@rule(
    "data-and-tokenizer", phase="layout", flags=("--mock-data", "--data-path", "--tokenizer-type")
)
def _data_and_tokenizer(args):
    """Training needs data (mock or indexed) and a tokenizer that can be built."""
    problems = []
    has_data = (
        args.mock_data
        or args.data_path
        or getattr(args, "data_args_path", None)
        or getattr(args, "per_split_data_args_path", None)
        or any(getattr(args, f"{s}_data_path", None) for s in ("train", "valid", "test"))
    )
    paths = [
        f
        for f in (
            "--data-path",
            "--data-args-path",
            "--per-split-data-args-path",
            "--train-data-path",
            "--valid-data-path",
            "--test-data-path",
        )
        if getattr(args, f[2:].replace("-", "_"), None)
    ]
    if args.mock_data and paths:
        problems.append(
            f"--mock-data and {', '.join(paths)} are two data sources: drop --mock-data (the "
            "example configs set it) to train on your data."
        )
    if not has_data:
        problems.append(
            "no training data: pass --mock-data or --data-path (or --train-data-path ...)."
        )
    tok = args.tokenizer_type
    if tok is None:
        problems.append(
            "--tokenizer-type is not set: use NullTokenizer with --vocab-size for mock data, or "
            "the tokenizer your data was preprocessed with."
        )
    elif tok == "NullTokenizer" and not args.vocab_size:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size.")
    for flag in _FILE_TOKENIZERS.get(tok or "", ()):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if not value:
            problems.append(f"--tokenizer-type {tok} needs {flag}.")
        elif flag != "--tokenizer-model" and not os.path.exists(value):
            problems.append(f"{flag} {value} does not exist.")
    return " ".join(problems) or None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_blend(flag: str, words: list[str]) -> tuple[list[str], list[str]]:
    """(prefixes, problems) of one megatron data-path value: a prefix, prefixes, or weights and
    prefixes alternating (``0.3 /data/a 0.7 /data/b``); weights are positive and finite, as
    megatron's blended dataset asserts after it has built the datasets."""
    if len(words) > 1 and len(words) % 2 == 0 and any(_is_number(w) for w in words[::2]):
        bad = [w for w in words[::2] if not _is_number(w)]
        if bad:
            return [], [
                f"{flag} {' '.join(words)}: a blend alternates weights and prefixes, and "
                f"{', '.join(repr(b) for b in bad)} is not a weight"
            ]
        wrong = [
            f"{weight} (of {prefix})"
            for weight, prefix in zip(words[::2], words[1::2])
            if not (math.isfinite(float(weight)) and float(weight) > 0)
        ]
        if wrong:
            which = "weight" if len(wrong) == 1 else "weights"
            return [], [
                f"{flag}: the blend {which} {', '.join(wrong)} must be positive and finite "
                "(megatron samples each dataset in proportion to its weight; leave a dataset out "
                "rather than weighting it 0)"
            ]
        return list(words[1::2]), []
    stray = [w for w in words if _is_number(w) and not os.path.exists(w + ".idx")]
    if stray:
        return [], [
            f"{flag} {' '.join(words)}: {', '.join(repr(w) for w in stray)} reads as a weight, but "
            "a weighted blend needs a weight before every prefix"
        ]
    return list(words), []


def data_prefixes(args) -> tuple[list[tuple[str, str]], list[str]]:
    """([(flag, prefix)], problems) of every dataset the run reads (not with --mock-data)."""
    found, problems = [], []

    def add(flag, words):
        prefixes, bad = parse_blend(flag, list(words))
        found.extend((flag, p) for p in prefixes)
        problems.extend(bad)

    if getattr(args, "mock_data", False):
        return [], []
    if args.data_path:
        add("--data-path", args.data_path)
    for split in ("train", "valid", "test"):
        if getattr(args, f"{split}_data_path", None):
            add(f"--{split}-data-path", getattr(args, f"{split}_data_path"))
    path = getattr(args, "data_args_path", None)
    if path:
        if not os.path.isfile(path):
            problems.append(f"--data-args-path {path}: no such file")
        else:
            with open(path) as handle:
                add(f"--data-args-path {path}", handle.read().split())
    path = getattr(args, "per_split_data_args_path", None)
    if path:
        try:
            with open(path) as handle:
                per_split = json.load(handle)
            for split in ("train", "valid", "test"):
                words = per_split[split]
                add(
                    f"--per-split-data-args-path {path} ({split})",
                    words.split() if isinstance(words, str) else words,
                )
        except FileNotFoundError:
            problems.append(f"--per-split-data-args-path {path}: no such file")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(
                f"--per-split-data-args-path {path}: not a JSON object with train, valid and "
                f"test lists ({type(exc).__name__}: {exc})"
            )
    return found, problems


def index_dtype(idx_path: str):
    """The token dtype recorded in a megatron .idx file, or None when the header is not
    megatron's."""
    from megatron.core.datasets.indexed_dataset import DType

    with open(idx_path, "rb") as handle:
        if handle.read(9) != INDEX_HEADER:
            return None
        handle.read(8)  # version
        code = handle.read(1)
    try:
        return DType.dtype_from_code(struct.unpack("<B", code)[0])
    except (struct.error, ValueError, KeyError):
        return None


def prefix_problem(flag: str, prefix: str) -> str | None:
    """Why ``prefix`` is not a megatron indexed dataset (its .bin and .idx), or None."""
    if prefix.startswith(REMOTE_PREFIXES):
        return None
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            return (
                f"{flag} {prefix}: give the prefix without {ext} ({prefix[: -len(ext)]}); megatron "
                "reads <prefix>.bin and <prefix>.idx"
            )
    if os.path.isdir(prefix):
        names = sorted(n[:-4] for n in os.listdir(prefix) if n.endswith(".idx"))[:3]
        hint = f" (e.g. {os.path.join(prefix, names[0])})" if names else ""
        return (
            f"{flag} {prefix} is a directory: give the prefix of a <prefix>.bin/<prefix>.idx pair"
            f"{hint}"
        )
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        return f"{flag} {prefix}: {' and '.join(missing)} not found"
    if index_dtype(prefix + ".idx") is None:
        return (
            f"{flag} {prefix}: {prefix}.idx is not a megatron indexed dataset index (bad header); "
            "build the dataset with megatron's tools/preprocess_data.py"
        )
    problem = index_size_problem(prefix)
    return f"{flag} {prefix}: {problem}" if problem else None


def index_size_problem(prefix: str) -> str | None:
    """Whether ``prefix``.idx holds the tables its header counts and ``prefix``.bin the bytes its
    last sequence ends at. Reads the header and the last entries of the length and offset
    tables, not the tokens."""
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    with open(idx, "rb") as handle:
        head = handle.read(len(INDEX_HEADER) + INDEX_COUNTS.size)
        if len(head) < len(INDEX_HEADER) + INDEX_COUNTS.size:
            return f"{idx} ends inside its header (truncated)"
        version, code, sequences, documents = INDEX_COUNTS.unpack_from(head, len(INDEX_HEADER))
        if version != 1:
            return f"{idx} is index version {version}; megatron-core reads version 1"
        start = len(head)
        least = start + sequences * (4 + 8) + documents * 8
        size = os.path.getsize(idx)
        if size < least:
            return (
                f"{idx} is {size:,} bytes, but its header counts {sequences:,} sequences and "
                f"{documents:,} documents ({least:,} bytes): truncated"
            )
        if not sequences:
            return None
        handle.seek(start + (sequences - 1) * 4)
        (length,) = struct.unpack("<i", handle.read(4))
        handle.seek(start + sequences * 4 + (sequences - 1) * 8)
        (offset,) = struct.unpack("<q", handle.read(8))
    needed = offset + length * DType.size(DType.dtype_from_code(code))
    have = os.path.getsize(bin_)
    if have < needed:
        return (
            f"{bin_} is {have:,} bytes, but {idx} places its last sequence at bytes "
            f"{offset:,}-{needed:,} (truncated, or the .bin of another index); copy or build the "
            "dataset again"
        )
    return None


@rule(
    "data-files",
    phase="layout",
    flags=(
        "--data-path",
        "--train-data-path",
        "--valid-data-path",
        "--test-data-path",
        "--data-args-path",
        "--per-split-data-args-path",
    ),
)
def _data_files(args):
    """Every dataset prefix names a .bin and a megatron .idx file, the .bin as long as the .idx
    describes; blends parse, with positive finite weights."""
    found, problems = data_prefixes(args)
    problems += [p for p in (prefix_problem(flag, prefix) for flag, prefix in found) if p]
    return listed("", problems)


@rule(
    "tokenizer-files",
    phase="layout",
    flags=("--tokenizer-type", "--tokenizer-model"),
)
def _tokenizer_files(args):
    """A tokenizer model given as a path exists (a Hugging Face hub id is loaded at launch)."""
    value = getattr(args, "tokenizer_model", None)
    tok = args.tokenizer_type
    if not value or tok not in _FILE_TOKENIZERS or os.path.exists(value):
        return None
    hub_id = tok == "HuggingFaceTokenizer" and not value.startswith(("/", ".", "~"))
    if hub_id and value.count("/") <= 1:
        return None
    return f"--tokenizer-model {value}: no such file or directory (--tokenizer-type {tok})."


def max_token_id(prefix: str, sample: int = SAMPLED_TOKENS) -> int | None:
    """The largest token id in up to ``sample`` tokens of ``prefix``.bin, read in 64 evenly spaced
    chunks (the whole file when it is smaller)."""
    import numpy

    dtype = index_dtype(prefix + ".idx")
    if dtype is None or not os.path.getsize(prefix + ".bin"):
        return None
    tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if len(tokens) <= sample:
        return int(tokens.max())
    step, width = len(tokens) // 64, sample // 64
    return int(max(tokens[i : i + width].max() for i in range(0, step * 64, step)))


@rule(
    "data-token-ids-within-vocabulary",
    phase="combination",
    flags=("--data-path", "--vocab-size", "--tokenizer-type", "--tokenizer-model"),
)
def _token_ids_within_vocabulary(args, config):
    """Token ids of the data must index the embedding (else an IndexError in training)."""
    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None and args.tokenizer_type == "NullTokenizer" and args.vocab_size:
        vocab = args.vocab_size + 1  # NullTokenizer adds an end-of-document token
    found, problems = data_prefixes(args)
    if vocab is None or problems:
        return None
    for flag, prefix in found[:16]:
        if prefix_problem(flag, prefix):
            continue
        top = max_token_id(prefix)
        if top is not None and top >= vocab:
            return (
                f"{flag} {prefix} holds token id {top}, but the vocabulary has {vocab} entries "
                f"(--tokenizer-type {args.tokenizer_type}"
                + (f" --vocab-size {args.vocab_size}" if args.vocab_size else "")
                + "): the data was tokenized with another tokenizer. Use that tokenizer, or a "
                "larger --vocab-size with NullTokenizer."
            )
    return None
