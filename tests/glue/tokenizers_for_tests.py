"""Two small tokenizers built in-process with `tokenizers` (no downloads) that reproduce the
hard cases of real ones: a Llama-style SentencePiece BPE with byte fallback and a "▁" space
marker whose decoder strips the first leading space, and a byte-level BPE (GPT-2 / Qwen)."""
from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — 東京 ☃ 😀 ünïcödé text",
    "Streaming text must keep its spaces and its multi-byte characters intact.",
] * 20


@functools.lru_cache(maxsize=None)
def llama_like() -> PreTrainedTokenizerFast:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz"), limit_alphabet=40)
    tok.train_from_iterator([c for c in CORPUS], trainer)
    # byte-fallback pieces are ordinary vocabulary entries (as in Llama), not special tokens
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in byte_tokens:
        vocab.setdefault(b, len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def bytelevel() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
