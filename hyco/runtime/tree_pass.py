"""One forward pass of a transformers causal LM over a draft tree on top of a KV cache.

Used by the reference verifier and by the float SLM drafter (and the oracle drafter, which is the
verifier wrapped as an SLM); with Gemma 4 as the paper's models, and with a decoder of another
family (Llama, Qwen) as the verifier behind the token bridge (hyco/runtime/bridge.py), which
takes one 4D mask for its full-attention layers and hands nothing off. The recipe is the one platform.md checked: per-layer-type 4D additive
masks (`attention_mask={"full_attention": ..., "sliding_attention": ...}`) with explicit
`position_ids` (a node at depth d sits at position base + d).

The cache is a plain `DynamicCache()` (no config), so no layer evicts keys: transformers' sliding
layers drop old keys, which would make rolling back a rejected tree impossible and force the
sliding mask to a different key length (the trap in platform.md). The sliding window is applied
in our mask instead (a key is visible when q_pos - k_pos < window, transformers' rule). With
rings (the phone's SLM Drafter, section 3.4) a full layer's window is `ring_full` and a sliding
layer's the smaller of `ring_sliding` and the model's window, as in hyco/npu/host.py, and keys
no row can see again are dropped from the cache.

After a pass the tree rows sit in the cache as pending; `commit(rows)` keeps the K/V of the given
rows (the root and the accepted path) and drops the rest; `rollback(n)` forgets the last n committed
tokens (the bridge's SLM, whose last committed tokens re-tokenize once more text follows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hyco.npu.handoff import input_device

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class PassOutput:
    logits: torch.Tensor  # [n, V] float32, after the final softcap
    hidden_after_norm: torch.Tensor  # [n, H]: transformers' hidden_states[-1], what its MTP generator feeds
    hidden_before_norm: torch.Tensor  # [n, H]: the paper's h_t (section 3.1, appendix)
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (k, v) [kv_heads, n, head_dim]


class CachedTreeModel:
    """A causal LM with a growing committed context and one pending tree at a time."""

    def __init__(self, model, *, ring_full: int | None = None, ring_sliding: int | None = None):
        self.model = model.eval()
        self.device = input_device(model)
        config = model.config.get_text_config()
        self.sliding_window = getattr(config, "sliding_window", None)
        self.layer_types = [t for t in (FULL, SLIDING) if t in (getattr(config, "layer_types", None) or [FULL])]
        self.gemma4 = hasattr(config, "num_kv_shared_layers")  # returns the shared K/V the hand-off carries
        self.ring = {FULL: ring_full, SLIDING: ring_sliding}
        self.cache = DynamicCache()
        self.key_positions = torch.zeros(0, dtype=torch.long)  # position of every cached key
        self.committed = 0  # number of committed tokens processed so far (next position)
        self.pending = 0  # rows of the last pass still in the cache
        self._norm_io: dict[str, torch.Tensor] = {}

    def _capture_norm(self, module, args, output):
        self._norm_io["before"], self._norm_io["after"] = args[0], output

    def _windows(self) -> dict[str, int | None]:
        """Keys a row may see, itself included, per layer type (None: no limit). On the phone a
        full layer's window is its ring, a sliding layer's the smaller of ring and model window
        (hyco/npu/host.py's rule, so the float SLM sees what the SLM graph sees)."""
        full, sliding = self.ring[FULL], self.ring[SLIDING]
        windows = {FULL: full}
        if SLIDING in self.layer_types:
            windows[SLIDING] = self.sliding_window if sliding is None else min(sliding, self.sliding_window)
        return windows

    def _masks(self, row_positions: torch.Tensor, ancestor: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = self.model.dtype
        masks = {}
        for layer_type, window in self._windows().items():
            visible_past = torch.ones(len(row_positions), len(self.key_positions), dtype=torch.bool)
            visible_tree = ancestor.clone()
            if window is not None:
                # transformers' sliding rule: a key is visible when q_pos - k_pos < window.
                visible_past &= row_positions[:, None] - self.key_positions[None, :] < window
                visible_tree &= row_positions[:, None] - row_positions[None, :] < window
            visible = torch.cat([visible_past, visible_tree], dim=1)
            mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
            masks[layer_type] = mask[None, None]
        return masks

    @torch.no_grad()
    def forward_tree(self, tokens: list[int], parents: list[int]) -> PassOutput:
        """Run a tree whose row 0 follows the committed context (parents[0] == -1, parents index
        earlier rows). A plain sequence is the chain parents = [-1, 0, 1, ...]."""
        if self.pending:
            raise RuntimeError("commit() the previous pass before running another")
        n = len(tokens)
        ancestor = torch.zeros(n, n, dtype=torch.bool)
        depth = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(parents):
            ancestor[i, i] = True
            if p >= 0:
                ancestor[i] |= ancestor[p]
                depth[i] = depth[p] + 1
        positions = self.committed + depth
        # One hook on the final norm gives both capture points (its input and its output); it is
        # removed after the pass, since several runners may share one model.
        masks = {t: m.to(self.device) for t, m in self._masks(positions, ancestor).items()}
        extra = {"return_shared_kv_states": True} if self.gemma4 else {}
        hook = self.model.get_decoder().norm.register_forward_hook(self._capture_norm)
        try:
            out = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=positions[None].to(self.device),
                attention_mask=masks if len(masks) > 1 or self.gemma4 else masks[FULL],
                cache=self.cache,
                use_cache=True,
                **extra,
            )
        finally:
            hook.remove()
        self.key_positions = torch.cat([self.key_positions, positions])
        self.pending = n
        # what leaves the pass is float32 on the CPU, wherever the model runs: the acceptance rules,
        # the hand-off and the metrics work there
        shared = {t: (k[0, :, -n:].float().cpu(), v[0, :, -n:].float().cpu())
                  for t, (k, v) in (getattr(out, "shared_kv_states", None) or {}).items()}
        return PassOutput(out.logits[0].float().cpu(), self._norm_io["after"][0].float().cpu(),
                          self._norm_io["before"][0].float().cpu(), shared)

    def commit(self, rows: list[int]) -> None:
        """Keep the pending rows `rows` (in order: root, then the accepted path) and drop the rest."""
        keep = torch.cat([torch.arange(len(self.key_positions) - self.pending),
                          len(self.key_positions) - self.pending + torch.tensor(rows, dtype=torch.long)])
        keep = keep[self._inside_ring(keep, extra=len(rows))]
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                index = keep.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.key_positions = self.key_positions[keep]
        self.committed += len(rows)
        self.pending = 0

    def rollback(self, count: int) -> None:
        """Forget the last `count` committed tokens (no pass pending). Keys a ring had already
        dropped stay dropped: the window is short by those rows until new tokens refill it."""
        if self.pending:
            raise RuntimeError("commit() the pending pass before rolling back")
        if not 0 <= count <= self.committed:
            raise ValueError(f"cannot roll back {count} of {self.committed} committed tokens")
        keep = self.key_positions < self.committed - count
        index = torch.nonzero(keep).flatten()
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))
        self.key_positions = self.key_positions[keep]
        self.committed -= count

    def _inside_ring(self, keep: torch.Tensor, extra: int) -> torch.Tensor:
        """Drop keys that no mask can show again (every later row sits at a position >= the
        committed length), so the phone drafter's memory stays bounded by its ring."""
        windows = self._windows().values()
        if any(w is None for w in windows):
            return torch.ones(len(keep), dtype=torch.bool)
        oldest_visible = self.committed + extra - max(windows) + 1
        return self.key_positions[keep] >= oldest_visible

    def prefill(self, tokens: list[int], chunk: int = 512, start_position: int = 0) -> PassOutput:
        """Commit a prompt in chunks starting at `start_position` (a prompt cut to its last
        tokens keeps its absolute positions). Returns the last row's logits and hidden states and
        the shared K/V of every prompt row."""
        if self.committed == 0 and not len(self.key_positions):
            self.committed = start_position
        outs = []
        for start in range(0, len(tokens), chunk):
            piece = tokens[start:start + chunk]
            out = self.forward_tree(piece, [-1] + list(range(len(piece) - 1)))
            self.commit(list(range(len(piece))))
            outs.append(out)
        shared = {t: (torch.cat([o.shared_kv[t][0] for o in outs], 1), torch.cat([o.shared_kv[t][1] for o in outs], 1))
                  for t in outs[-1].shared_kv}
        last = outs[-1]
        return PassOutput(last.logits[-1:], last.hidden_after_norm[-1:], last.hidden_before_norm[-1:], shared)
