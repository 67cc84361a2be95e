"""Pre-tokenization (issue 14, item 3): `zoo tokenize` runs the frozen visual tokenizer and audio codec once
over a corpus and writes WebDataset code shards that `CodeShardSource` streams into training, so that
training never runs the tokenizers (REFERENCES.md Part C, "Do this" 1-3).

    sources.py   inputs cut into units (one output shard each); the DataLoader workers' decoded stream,
                 read and decoded by the paired datamodule's own sources (`zoo.datamodules.sources`)
    frozen.py    the frozen tokenizers loaded from configs + weights or a model (their batched encoding:
                 zoo.datamodules.frozen_tokenizers)
    output.py    the output folder: temporary names, commit by rename, skip finished, index, failures
    run.py       one tokenization: batching, writing, progress (`tokenize_corpus`)
    command.py   the `zoo tokenize` command line

The record format itself (`zoo.datamodules.code_records`) and the tokenizer fingerprint (`zoo.fingerprint`)
live lower in the house: the datamodule that reads the shards needs them too.
"""

from zoo.datamodules.frozen_tokenizers import FrozenTokenizers
from zoo.pretokenize.frozen import load_component, model_tokenizers
from zoo.pretokenize.run import TokenizeResult, tokenize_corpus

__all__ = [
    "FrozenTokenizers",
    "TokenizeResult",
    "load_component",
    "model_tokenizers",
    "tokenize_corpus",
]
