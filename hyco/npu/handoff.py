"""The verifier-to-phone hand-off: what the server sends so the MTP head can draft.

After the verifier has checked a draft, the phone's MTP head drafts the next burst from three
things the verifier computed at the last verified position t (the gemma4_assistant contract,
transformers `SinglePositionMultiTokenCandidateGenerator`):
- e(x_{t+1}): the verifier's *input* embedding of the token it just chose, scaled by sqrt(H)
  exactly as `Gemma4TextScaledWordEmbedding` returns it (the head consumes cat(e, h));
- h_t: the verifier's last hidden state at t, at a capture point: "after_norm" is what
  transformers' reference feeds (`hidden_states[-1]`, after the final norm), "before_norm" is
  the paper's (the final norm's input, taken with a hook);
- K/V of the verifier's last full-attention and last sliding-window layer over positions 0..t
  (`return_shared_kv_states=True`), [kv_heads, positions, head_dim] per layer type.
The head then drafts at the constant position t + 1.

Wire format for the K/V rows: int8, symmetric, one float16 scale per (head, position) row,
so a row dequantizes on its own as soon as it arrives (`quantize_kv_rows`).

Used by qat/ (captures for training) and runtime_check/ (the live hand-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.npu.host import LAYER_TYPES  # the one layer-type table

CAPTURE_POINTS = ("after_norm", "before_norm")


@dataclass(frozen=True)
class StepInput:
    """Everything one MTP drafting burst starts from (batch-free tensors)."""

    embed: torch.Tensor  # [Hb] e(x_{t+1}) as the head consumes it
    hidden: torch.Tensor  # [Hb] h_t at the capture point
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # type -> (K, V), each [kv_heads, t+1, head_dim]
    position: int  # t + 1: the head's constant position within the burst


@dataclass(frozen=True)
class HandoffStates:
    """Per-position hand-off states of one verifier pass over `input_ids` (length N).

    Row j of `embeds` is e(x_j); row j of `hidden` is h_j; K/V hold every position.
    `at(t)` cuts out the drafting input after position t (needs t + 1 < N).
    """

    input_ids: torch.Tensor  # [N] long
    embeds: torch.Tensor  # [N, Hb]
    hidden: torch.Tensor  # [N, Hb]
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # type -> (K, V) [kv_heads, N, head_dim]
    capture_point: str

    def at(self, t: int, kv_len: int | None = None) -> StepInput:
        n = self.input_ids.shape[0]
        if not 0 <= t < n - 1:
            raise ValueError(f"t must be in [0, {n - 2}], but got {t}")
        # kv_len defaults to the t + 1 positions the verifier has seen; transformers' reference
        # sometimes passes one stale row more (see tests/test_handoff.py), hence the override.
        kv_len = t + 1 if kv_len is None else kv_len
        kv = {name: (k[:, :kv_len], v[:, :kv_len]) for name, (k, v) in self.kv.items()}
        return StepInput(self.embeds[t + 1], self.hidden[t], kv, t + 1)


def text_model(verifier: torch.nn.Module) -> torch.nn.Module:
    """The Gemma 4 text decoder inside a `Gemma4ForCausalLM` (or a multimodal wrapper)."""
    decoder = verifier.get_decoder()
    if not hasattr(decoder, "norm") or not hasattr(decoder, "embed_tokens"):
        raise HycoError(f"verifier {type(verifier).__name__}: no Gemma 4 text decoder with norm/embed_tokens")
    return decoder


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs go: its input embedding's device (accelerate's hooks move them on
    from there); an embedding offloaded to disk sits on meta, and its hook takes CPU inputs."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


@torch.no_grad()
def embed_tokens(verifier: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """e(x) exactly as the assistant consumes it: the verifier's scaled input embedding, on the
    embedding's device."""
    return verifier.get_input_embeddings()(token_ids.to(input_device(verifier)))


@torch.no_grad()
def handoff_states(verifier: torch.nn.Module, input_ids: torch.Tensor,
                   capture_point: str = "after_norm") -> HandoffStates:
    """Run the verifier once over `input_ids` ([N] or [1, N]) and return its hand-off states."""
    if capture_point not in CAPTURE_POINTS:
        raise HycoError(f"qat.capture_point must be one of {list(CAPTURE_POINTS)}, but got {capture_point!r}")
    ids = input_ids.reshape(1, -1).to(verifier.device)
    decoder = text_model(verifier)
    captured = {}

    # One hook on the final norm serves both capture points: its input is the paper's h_t,
    # its output is transformers' hidden_states[-1].
    def grab(module, args, output):
        captured["before_norm"] = args[0]
        captured["after_norm"] = output

    handle = decoder.norm.register_forward_hook(grab)
    try:
        # The decoder alone: no N x vocab logits, and no `logits_to_keep` slicing, which would
        # cut the hidden states of KV-shared layers down to the last position.
        out = decoder(input_ids=ids, use_cache=False, return_shared_kv_states=True)
    finally:
        handle.remove()
    shared = out.shared_kv_states
    missing = [t for t in LAYER_TYPES if t not in (shared or {})]
    if missing:
        raise HycoError(f"verifier {type(verifier).__name__}: no shared K/V for {missing} "
                        "(needs a Gemma 4 text model whose last layer of each type stores K/V)")
    kv = {t: (shared[t][0][0].float(), shared[t][1][0].float()) for t in LAYER_TYPES}
    return HandoffStates(
        input_ids=ids[0].cpu(),
        embeds=embed_tokens(verifier, ids)[0].float(),
        hidden=captured[capture_point][0].float(),
        kv=kv,
        capture_point=capture_point,
    )


# --- the wire: int8 K/V rows with one scale per (head, position) ---------------------------


def quantize_kv_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[heads, n, dim] float -> (int8 [heads, n, dim], float16 scales [heads, n, 1]).

    Symmetric per (head, position) row; the scale is rounded to float16 *before* quantizing,
    so sender and receiver use the very same scale.
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.maximum(amax / 127.0, np.float32(1e-8)).astype(np.float16)
    q = np.clip(np.rint(x / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return q, scale


def dequantize_kv_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale.astype(np.float32)


def kv_wire_bytes(heads: int, positions: int, head_dim: int) -> int:
    """Bytes on the wire for one K or V block: int8 values + one float16 scale per row."""
    return heads * positions * (head_dim + 2)


# --- attention masks over the hand-off rows (host side, numpy) -------------------------------


def attention_masks(kv_positions: np.ndarray, query_positions: np.ndarray, sliding_window: int,
                    negative: float = -50.0) -> tuple[np.ndarray, np.ndarray]:
    """Additive masks [T, W] for the head's full- and sliding-attention layers.

    `kv_positions[w]` is the position held by K/V row w (-1: empty slot); a query at position
    q sees rows with 0 <= p < q. The sliding layers see only p >= q - (sliding_window + 1):
    transformers' assistant builds its sliding mask bidirectionally with an inclusive distance
    (|i - j| <= window) from the newest row, i.e. window + 1 rows back from q - 1.
    `negative` is small on purpose (it shares Softmax's 16-bit input range on HTP).
    """
    p = np.asarray(kv_positions, dtype=np.int64)[None, :]
    q = np.asarray(query_positions, dtype=np.int64)[:, None]
    seen = (p >= 0) & (p < q)
    in_window = seen & (q - p <= sliding_window + 1)
    full = np.where(seen, 0.0, negative).astype(np.float32)
    sliding = np.where(in_window, 0.0, negative).astype(np.float32)
    return full, sliding
