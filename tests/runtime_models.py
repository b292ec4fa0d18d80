"""Tiny random Gemma 4 models for the runtime tests that do not need the fixture family.

Shapes mimic the fixtures' structure (sliding + full layers, K=V full layers on the verifier,
per-layer inputs and KV sharing on the SLM) with a sliding window small enough that prompts cross it.
"""

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

VOCAB = 96


def tiny_gemma4(seed: int = 0, *, kv_shared: bool = False, sliding_window: int = 8, vocab: int = VOCAB) -> Gemma4ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4 if not kv_shared else 6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=not kv_shared,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        if not kv_shared else ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=sliding_window, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=8 if kv_shared else 0, vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=3 if kv_shared else 0, use_double_wide_mlp=kv_shared,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    model = Gemma4ForCausalLM(config).eval()
    # Random init is near-uniform; sharpen the output so argmax ties are out of reach of rounding.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.set_attn_implementation("eager")
    return model
