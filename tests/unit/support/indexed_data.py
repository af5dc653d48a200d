"""Tiny megatron indexed datasets (``<prefix>.bin`` / ``<prefix>.idx``) written with megatron's
own builder, for the data-path tests."""

import numpy
import torch


def write_dataset(
    prefix, *, documents=64, length=300, vocab=4096, top_token=None, seed=0, counting=False
):
    """``documents`` documents of ``length`` token ids below ``vocab`` (the last token of the last
    document is ``top_token`` when given); random ids, or with ``counting`` runs that count up
    from a random start (a model learns those within a few dozen steps). Returns the prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    dtype = numpy.uint16 if vocab < 65500 and (top_token or 0) < 65500 else numpy.int32
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for i in range(documents):
        if counting:
            tokens = (rng.integers(0, vocab - 1) + numpy.arange(length)) % (vocab - 1)
        else:
            tokens = rng.integers(0, vocab - 1, size=length)
        if top_token is not None and i == documents - 1:
            tokens[-1] = top_token
        builder.add_document(torch.from_numpy(tokens.astype(numpy.int64)), [length])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)
