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


def tiny_assistant(seed: int = 1, centroids: tuple[int, int] | None = None) -> Gemma4AssistantForCausalLM:
    """`centroids` (num_centroids, top_k): the centroid-masked output layer (use_ordered_embeddings),
    a random token ordering with each centroid its members' mean output row."""
    torch.manual_seed(seed)
    text = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=SLIDING_WINDOW,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2)
    ordered = {} if centroids is None else {"use_ordered_embeddings": True, "num_centroids": centroids[0],
                                            "centroid_intermediate_top_k": centroids[1]}
    head = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, **ordered)).eval()
    # Random init leaves near-zero weights; widen them so drafts depend on the inputs.
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
        if centroids is not None:
            order = torch.randperm(VOCAB)
            head.masked_embedding.token_ordering.copy_(order)
            rows = head.lm_head.weight[order].view(centroids[0], VOCAB // centroids[0], -1)
            head.masked_embedding.centroids.weight.copy_(rows.mean(1))
    head.generation_config.num_assistant_tokens = 4
    return head
