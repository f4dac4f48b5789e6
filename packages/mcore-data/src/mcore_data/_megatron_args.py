"""Megatron-LM ``tools/preprocess_data.py`` flag spellings for ``mcore-data preprocess``, with Megatron's meaning.

Using any Megatron-only spelling (or ``--megatron-naming``) switches to Megatron's conventions: no EOD unless
``--append-eod``, and outputs named ``PREFIX_KEY_document`` (``PREFIX_KEY_sentence`` with ``--split-sentences``),
one pair per ``--json-keys`` key. The table in ``docs/data.md`` lists every flag.
"""

from __future__ import annotations

import argparse

from mcore_data.errors import ConfigError

__all__ = ["MEGATRON_TOKENIZERS", "add_megatron_args", "megatron_mode", "megatron_outputs", "resolve_tokenizer"]

#: Megatron tokenizer types and the tokenizer kind that reads the same files here (None: not available).
MEGATRON_TOKENIZERS: dict[str, str | None] = {
    "GPT2BPETokenizer": "gpt2-bpe",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "SentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "HuggingFaceTokenizer": "hf",
    "BertWordPieceLowerCase": None,
    "BertWordPieceCase": None,
    "TikTokenizer": None,
    "NullTokenizer": None,
    "MultimodalTokenizer": None,
}

_MEGATRON_ONLY = ("json_keys", "append_eod", "vocab_file", "merge_file", "dataset_impl", "partitions", "log_interval",
                  "keep_sequential_samples", "keep_newlines", "lang")  # fmt: skip


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    """Megatron's spellings; each defaults to None so that :func:`megatron_mode` can tell whether it was given."""
    g = p.add_argument_group("Megatron-LM preprocess_data.py compatibility")
    g.add_argument("--json-keys", nargs="+", help="Megatron: keys to tokenize, one output pair per key")
    g.add_argument("--append-eod", action="store_true", default=None, help="Megatron: append EOD (off by default)")
    g.add_argument("--vocab-file", help="Megatron GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="Megatron GPT2BPETokenizer: merges.txt")
    g.add_argument("--dataset-impl", choices=["mmap"], help="Megatron (old): only mmap exists")
    g.add_argument("--partitions", type=int, help="Megatron: accepted; ignored (input order is always kept)")
    g.add_argument("--log-interval", type=int, help="Megatron: accepted; ignored (a progress bar shows progress)")
    g.add_argument("--keep-sequential-samples", action="store_true", default=None, help="Megatron: accepted; ignored")
    g.add_argument("--keep-newlines", action="store_true", default=None,
                   help="with --split-sentences: keep the whitespace between sentences")  # fmt: skip
    g.add_argument("--lang", help="with --split-sentences and NLTK: punkt language (default english)")
    g.add_argument("--megatron-naming", action="store_true",
                   help="name outputs PREFIX_KEY_document (or _sentence) as Megatron does")  # fmt: skip


def megatron_mode(args: argparse.Namespace) -> bool:
    """Whether Megatron's conventions apply: ``--megatron-naming`` or any Megatron-only spelling was given."""
    if args.megatron_naming or args.tokenizer_type in MEGATRON_TOKENIZERS:
        return True
    return any(getattr(args, name) is not None for name in _MEGATRON_ONLY)


def resolve_tokenizer(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """(kind, model path, merges path) of the tokenizer named by ``--tokenizer-type`` in either spelling."""
    kind = args.tokenizer_type
    if kind in MEGATRON_TOKENIZERS:
        mapped = MEGATRON_TOKENIZERS[kind]
        if mapped is None:
            raise ConfigError(
                f"--tokenizer-type {kind} is not available in mcore-data; use GPT2BPETokenizer, "
                "GPTSentencePieceTokenizer, SentencePieceTokenizer, Llama2Tokenizer or HuggingFaceTokenizer"
            )
        kind = mapped
    if kind == "gpt2-bpe":
        if not args.vocab_file or not args.merge_file:
            raise ConfigError("GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
        return kind, args.vocab_file, args.merge_file
    return kind, args.tokenizer_model, None


def megatron_outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(json key, output prefix) pairs: Megatron names when its conventions apply, else the prefix as given."""
    keys = args.json_keys or [args.json_key]
    if not megatron_mode(args):
        return [(keys[0], args.output_prefix)]
    if args.no_append_eod and args.append_eod:
        raise ConfigError("--append-eod and --no-append-eod contradict each other")
    level = "sentence" if args.split_sentences else "document"
    return [(k, f"{args.output_prefix}_{k}_{level}") for k in keys]
