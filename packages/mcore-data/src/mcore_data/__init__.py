"""Megatron-compatible indexed datasets, tokenizers, GPT and blended datasets, and the mcore-data CLI.

numpy is the only core dependency: importing this package never imports torch (see :mod:`mcore_data.torch`).
"""

from mcore_data.blended import BlendedDataset
from mcore_data.builder import build_gpt_datasets, parse_blend
from mcore_data.errors import (
    ConfigError,
    EmptyInputError,
    ImageDecodeError,
    IndexFormatError,
    InputFormatError,
    MCoreDataError,
    MissingDependencyError,
    OutputExistsError,
)
from mcore_data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mcore_data.indexed import IndexedDataset, IndexedDatasetWriter, merge_datasets, optimal_dtype, write_index
from mcore_data.mock import MockIndexedDataset
from mcore_data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerSpec,
    build_tokenizer,
)

__version__ = "0.1.0"

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "ConfigError",
    "EmptyInputError",
    "GPTDataset",
    "GPTDatasetConfig",
    "HFTokenizer",
    "ImageDecodeError",
    "IndexFormatError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "InputFormatError",
    "MCoreDataError",
    "MissingDependencyError",
    "MockIndexedDataset",
    "OutputExistsError",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerSpec",
    "__version__",
    "build_gpt_datasets",
    "build_tokenizer",
    "merge_datasets",
    "optimal_dtype",
    "parse_blend",
    "write_index",
]
