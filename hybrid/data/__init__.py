"""Data pipeline: tokenizer, indexed datasets, GPT samples, blending and layout-invariant sampling.

Names are imported on first use so that the preprocessing tools (numpy and
sentencepiece only) do not pay for importing torch.
"""

from __future__ import annotations

from hybrid.lazy_exports import lazy_exports

_EXPORTS = {
    "SentencePieceTokenizer": ".tokenizer",
    "train_sentencepiece": ".tokenizer",
    "GPT2BPETokenizer": ".gpt2_bpe",
    "train_gpt2_bpe": ".gpt2_bpe",
    "HuggingFaceTokenizer": ".hf_tokenizer",
    "load_tokenizer": ".tokenizer_choice",
    "IndexedDataset": ".indexed",
    "IndexedDatasetWriter": ".indexed",
    "IndexFormatError": ".indexed",
    "DataError": ".errors",
    "DataFileNotFoundError": ".errors",
    "SplitTooSmallError": ".errors",
    "best_dtype": ".indexed",
    "merge_datasets": ".indexed",
    "write_dataset": ".indexed",
    "preprocess": ".preprocess",
    "BadInputError": ".preprocess",
    "GPTDataset": ".gpt_dataset",
    "build_gpt_indices": ".gpt_dataset",
    "make_sample": ".gpt_dataset",
    "BlendedDataset": ".blended",
    "build_train_valid_test_datasets": ".blended",
    "parse_data_path": ".blended",
    "parse_split": ".blended",
    "GlobalBatchSampler": ".sampler",
    "MicroBatchSampler": ".sampler",
    "collate_samples": ".sampler",
    "iter_global_batches": ".sampler",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
