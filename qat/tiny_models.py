"""Tiny random Gemma 4 verifier + gemma4_assistant head built in memory, for tests that
need the MTP contract at shapes the fixture family does not have (sliding window 16, so short
sequences already cross it)."""

import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

VOCAB = 300
SLIDING_WINDOW = 16


def tiny_verifier(seed: int = 0) -> Gemma4ForCausalLM:
    torch.manual_seed(seed)
    cfg = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=SLIDING_WINDOW,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Gemma4ForCausalLM(cfg).eval()


def tiny_assistant(seed: int = 1) -> Gemma4AssistantForCausalLM:
    torch.manual_seed(seed)
    text = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING_WINDOW,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2)
    head = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64)).eval()
    # Random init leaves near-zero weights; widen them so drafts depend on the inputs.
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    head.generation_config.num_assistant_tokens = 4
    return head
