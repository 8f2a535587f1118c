"""Shared helpers for the data tests: synthetic corpora, tokenizers, datasets, tool loading."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np

from hybrid.data.indexed import write_dataset
from hybrid.data.tokenizer import train_sentencepiece

REPO = Path(__file__).resolve().parents[2]


def load_tool(name: str):
    """Import ``tools/{name}.py`` as a module (tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_documents(num_docs: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """Zipf-distributed made-up words: enough distinct text to train a vocab of a few hundred."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(600)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    docs = []
    for _ in range(num_docs):
        sentence = " ".join(rng.choices(words, weights, k=rng.randint(3, max_words)))
        docs.append(sentence.capitalize() + ".")
    return docs


def write_jsonl(path: Path, docs, key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({key: doc}) + "\n")
    return path


def train_tokenizer(tmp_path: Path, vocab_size: int = 300, num_docs: int = 400) -> str:
    return train_sentencepiece(synthetic_documents(num_docs, seed=1), tmp_path / "spm", vocab_size)


def unique_token_dataset(path_prefix, num_docs: int, seed: int = 0, max_len: int = 40, eod: int | None = None):
    """A dataset whose token values are their global positions, so every token is identifiable.

    Returns (IndexedDataset, list of the documents' token arrays). With ``eod``
    set, each document ends with that id instead (then only the other tokens
    are unique).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=num_docs)
    tokens = np.arange(int(lengths.sum()), dtype=np.int64)
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    if eod is not None:
        docs = [np.append(d[:-1], eod) for d in docs]
    dtype = np.uint16 if int(lengths.sum()) < 65500 and (eod is None or eod < 65500) else np.int32
    return write_dataset(path_prefix, docs, dtype=dtype), docs
