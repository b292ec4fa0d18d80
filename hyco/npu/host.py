"""Host-side pieces the phone's CPU runs around the NPU graphs. Plain numpy, no torch, so a
phone-side port has exactly one reference.

The whole API (what runtime_check/ and a phone port need):

- `EmbeddingLut.open(path)` then `lut.lookup(ids) -> float32[n, dim]`: the token embedding
  (`luts/embed_tokens.safetensors`) or the per-layer embedding (`luts/embed_tokens_per_layer
  .safetensors`, reshape to [n, layers, width]) exactly as transformers' QuantizedEmbedding
  returns them, scale and `embed_scale` included (bit-exact).
- `Rope.from_json(rope_json)` then `rope.tables(layer_type, positions) -> (cos, sin)`,
  float32[n, head_dim] each, for the graph inputs `cos_<type>` / `sin_<type>`.
- `KVRing(spec)`: one ring per KV-owning layer (`ring_full` or `ring_sliding` slots).
  `ring.feeds()` gives the ring inputs, `ring.write(outputs, rows, positions)` stores the
  graph's new rotated K/V rows at `position mod ring size`, `ring.truncate(length)` forgets
  positions >= length (after a rejected draft), and `ring.masks(positions, ancestors)` builds
  the additive masks `mask_<type>` for one pass.
- `tree_ancestors(parents)`: ancestor-or-self matrix of a tree given as parent indices
  (-1 for the root, parents before children); `tree_positions(parents, root_position)`;
  `chain_ancestors(n)` is the causal special case used by prefill.
- `prompt_window(ids, max_prompt) -> (ids, start_position)`: the phone prefills at most
  `max_prompt` (= `ring_full`) prompt tokens; a longer prompt keeps its last `max_prompt`
  tokens at their absolute positions, which start at `start_position`, not 0.
- `build_feeds(embed, per_layer, rope, ring, token_ids, positions, ancestors, active,
  num_layers)`: every input of one pass (check it with `GraphSpec.check_feeds`).
- `SlmHost(specs, sessions, luts, rope)`: the loop around the tree and prefill graphs that share
  one ring (`feeds`, `run`, `write`); the runtime's `SlmOnnx` and convert's parity
  `GraphRunner` both drive the graphs through it.

Which graph meta the host needs (io_spec.json, `meta` of each graph): `rows`, `num_layers`,
`rings` (owner layer, type, kv_heads, head_dim, slots), `windows`, `mask_negative`,
`kv_owner` (KV-shared layer -> the layer whose ring it reads), `keep_size`, `topk`.

Mask rule (equal to transformers' sliding window, `kv > q - window`): row i at absolute
position p sees a key at position s iff s <= p, p - s < window, and the key is i's own
ancestor (new rows) or a committed ring entry. The window of a full layer is `ring_full`, so
past the ring a full layer sees the last `ring_full` tokens, like transformers run on them.
Masked entries get `mask_negative` (-50), not -inf: the mask shares the Softmax input's
16-bit range on the HTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hyco.config.families import GEMMA4

# The one layer-type table, the family's: a config's layer type -> the suffix of its graph I/O
# (k_full, cos_sliding, ...)
SHORT = GEMMA4.layer_types
LAYER_TYPES = tuple(SHORT)


# --- embedding lookup tables --------------------------------------------------------------


def unpack_ints(packed: np.ndarray, bits: int, width: int) -> np.ndarray:
    """Gemma QAT packing -> int8 values: int4 two per byte low nibble first (+8), int2 four
    per byte from the low bits (+2), int8 as is."""
    if bits == 8:
        return packed.astype(np.int8)[..., :width]
    per_byte = 8 // bits
    u = packed.astype(np.uint8)
    fields = [(u >> (bits * k)) & ((1 << bits) - 1) for k in range(per_byte)]
    values = np.stack(fields, axis=-1).reshape(*u.shape[:-1], -1)[..., :width]
    # uint8 subtraction wraps to the two's-complement byte: no int16 copy of the block.
    return (values - np.uint8(1 << (bits - 1))).view(np.int8)


@dataclass
class EmbeddingLut:
    """A quantized embedding table kept on the CPU: packed rows + per-row (block) scales."""

    packed: np.ndarray  # uint8 [V, packed_dim] (int2/int4) or int8 [V, dim]
    scale: np.ndarray  # float32 [V, blocks]
    bits: int
    dim: int
    embed_scale: float  # transformers' architectural scale (sqrt(width)), applied after dequant

    @classmethod
    def open(cls, path: str | Path) -> EmbeddingLut:
        """Memory-maps the file: a lookup reads only the rows it asks for (the per-layer table
        of a real E2B is ~1 GB and never comes into memory whole)."""
        from hyco.base.errors import HycoError
        from hyco.base.loading import require_tensor

        tensors, meta = mmap_safetensors(path)
        try:
            bits, dim, embed_scale = int(meta["bits"]), int(meta["dim"]), float(meta["embed_scale"])
        except (KeyError, ValueError) as e:
            raise HycoError(f"{path}: LUT metadata lacks a valid bits/dim/embed_scale ({e})") from None
        packed, scale = require_tensor(tensors, "packed", path), require_tensor(tensors, "scale", path)
        if packed.ndim != 2 or scale.shape[:1] != packed.shape[:1]:
            raise HycoError(f"{path}: tensors 'packed' {list(packed.shape)} and 'scale' {list(scale.shape)} "
                            "must have one row per token")
        return cls(packed, scale, bits, dim, embed_scale)

    def value_range(self, chunk: int = 2048) -> tuple[float, float]:
        """Smallest and largest value any row can feed a graph (every token's row, as looked up),
        read `chunk` rows at a time."""
        lo, hi = np.inf, -np.inf
        for start in range(0, self.packed.shape[0], chunk):
            rows = self.lookup(np.arange(start, min(start + chunk, self.packed.shape[0])))
            lo, hi = min(lo, float(rows.min())), max(hi, float(rows.max()))
        return lo, hi

    def lookup(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ints = unpack_ints(self.packed[ids], self.bits, self.dim).astype(np.float32)
        scale = np.repeat(self.scale[ids], self.dim // self.scale.shape[-1], axis=-1)
        return (ints * scale) * np.float32(self.embed_scale)


NUMPY_DTYPES = {"U8": "u1", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "F16": "<f2", "F32": "<f4",
                "F64": "<f8"}


def mmap_safetensors(path: str | Path, names=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> read-only np.memmap, metadata) of a safetensors file (of `names` only, if
    given), after hyco.base.loading's header checks (dtype, shape and byte span of every entry,
    file not cut)."""
    from hyco.base.errors import HycoError
    from hyco.base.loading import safetensors_header

    header = safetensors_header(path)
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")  # data begins after the length and the header
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        if info["dtype"] not in NUMPY_DTYPES:
            raise HycoError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which the numpy reader does not map")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = info["data_offsets"]
        if end == begin:
            tensors[name] = np.zeros(shape, np.dtype(NUMPY_DTYPES[info["dtype"]]))
            continue
        tensors[name] = np.memmap(path, dtype=np.dtype(NUMPY_DTYPES[info["dtype"]]), mode="r", offset=start + begin,
                                  shape=shape)
    return tensors, dict(header.get("__metadata__") or {})


# --- rotary tables --------------------------------------------------------------------------


@dataclass
class Rope:
    """cos/sin per layer type from the inverse frequencies transformers computed (rope.json),
    times its attention_scaling (YaRN and the like scale both; Gemma 4's is 1), as
    Gemma4TextRotaryEmbedding computes them, in float32: the SLM's host and the MTP step use this
    one (tests/test_rope.py holds it to transformers')."""

    inv_freq: dict[str, np.ndarray]  # layer type -> float32 [head_dim / 2]
    scaling: dict[str, float] = field(default_factory=dict)  # layer type -> attention_scaling (absent: 1)

    @classmethod
    def from_json(cls, path_or_dict) -> Rope:
        d = path_or_dict if isinstance(path_or_dict, dict) else json.loads(Path(path_or_dict).read_text())
        return cls({t: np.asarray(v["inv_freq"], dtype=np.float32) for t, v in d["layer_types"].items()},
                   {t: float(v.get("attention_scaling", 1.0)) for t, v in d["layer_types"].items()})

    def tables(self, layer_type: str, positions) -> tuple[np.ndarray, np.ndarray]:
        pos = np.asarray(positions, dtype=np.float32).reshape(-1, 1)
        freqs = pos * self.inv_freq[layer_type][None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        scale = np.float32(self.scaling.get(layer_type, 1.0))
        return (np.cos(emb) * scale).astype(np.float32), (np.sin(emb) * scale).astype(np.float32)


# --- tree / chain structure ------------------------------------------------------------------


def tree_ancestors(parents) -> np.ndarray:
    """bool [n, n]: [i, j] is True when row j is row i or one of its ancestors.
    Parents must come before children (parent index < child index); the root has -1."""
    parents = np.asarray(parents, dtype=np.int64)
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        p = parents[i]
        if p >= i:
            raise ValueError(f"parents[{i}] = {p}: a parent must precede its child")
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def chain_ancestors(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def tree_positions(parents, root_position: int) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int64)
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return root_position + depth


def prompt_window(ids, max_prompt: int) -> tuple[np.ndarray, int]:
    """The prompt tokens the phone prefills and the absolute position of the first one.

    A prompt longer than `max_prompt` keeps only its last `max_prompt` tokens, and they keep
    their absolute positions (so rotary angles, and thus the keys stored in the ring, are
    those the full prompt would give them)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if max_prompt < 1:
        raise ValueError(f"prompt_window: max_prompt must be >= 1, but got {max_prompt}")
    start = max(0, len(ids) - max_prompt)
    return ids[start:], start


# --- KV ring ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingLayer:
    layer: int  # decoder layer index that owns (computes and stores) this K/V
    layer_type: str
    kv_heads: int
    head_dim: int
    slots: int


class KVRing:
    """K/V rings of every KV-owning layer plus the absolute position held by each slot.

    Keys are stored already rotated, so a cached key keeps its absolute position wherever it
    sits in the ring; slot positions only serve the mask."""

    def __init__(self, layers: list[RingLayer], windows: dict[str, int], rows: int, mask_negative: float):
        self.layers = layers
        self.windows = windows  # layer type -> effective window (keys a row may see, itself included)
        self.rows = rows
        self.mask_negative = np.float32(mask_negative)
        self.k = {r.layer: np.zeros((r.kv_heads, r.slots, r.head_dim), np.float32) for r in layers}
        self.v = {r.layer: np.zeros((r.kv_heads, r.slots, r.head_dim), np.float32) for r in layers}
        self.slots = {t: next(r.slots for r in layers if r.layer_type == t) for t in {r.layer_type for r in layers}}
        self.slot_positions = {t: np.full(n, -1, np.int64) for t, n in self.slots.items()}

    @classmethod
    def from_meta(cls, meta: dict, rows: int | None = None) -> KVRing:
        """Build from the `meta` of a graph in io_spec.json."""
        layers = [RingLayer(**r) for r in meta["rings"]]
        return cls(layers, meta["windows"], rows if rows is not None else meta["rows"], meta["mask_negative"])

    def feeds(self) -> dict[str, np.ndarray]:
        """The ring inputs as the live arrays (no copy: a pass reads them at once); `write`
        changes them in place, so a caller keeping feeds across passes must copy them."""
        feeds = {}
        for r in self.layers:
            feeds[f"k_ring_{r.layer}"] = self.k[r.layer]
            feeds[f"v_ring_{r.layer}"] = self.v[r.layer]
        return feeds

    def write(self, outputs: dict[str, np.ndarray], rows, positions) -> None:
        """Store new K/V rows `rows` (indices into the pass) that now hold `positions`."""
        rows = np.asarray(rows, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        for r in self.layers:
            slot = positions % r.slots
            self.k[r.layer][:, slot] = outputs[f"new_k_{r.layer}"][:, rows]
            self.v[r.layer][:, slot] = outputs[f"new_v_{r.layer}"][:, rows]
        for t, n in self.slots.items():
            self.slot_positions[t][positions % n] = positions

    def truncate(self, length: int) -> None:
        """Forget every slot holding a position >= length (a rejected speculation)."""
        for pos in self.slot_positions.values():
            pos[pos >= length] = -1

    def masks(self, positions, ancestors, active=None) -> dict[str, np.ndarray]:
        """Additive masks [rows, slots + rows] per layer type for one pass.

        `positions[i]` is row i's absolute position, `ancestors[i, j]` says row i may see row
        j, `active` (bool [rows]) marks padding rows, which then see only themselves."""
        positions = np.asarray(positions, dtype=np.int64)
        n = len(positions)
        if n != self.rows or ancestors.shape != (n, n):
            raise ValueError(f"masks: expected {self.rows} rows, got positions {n} and ancestors {ancestors.shape}")
        active = np.ones(n, dtype=bool) if active is None else np.asarray(active, dtype=bool)
        new_visible = ancestors & active[None, :] & active[:, None]
        new_visible |= np.eye(n, dtype=bool)
        out = {}
        for t, slot_pos in self.slot_positions.items():
            window = self.windows[t]
            p = positions[:, None]
            ring_visible = (slot_pos[None, :] >= 0) & (slot_pos[None, :] < p) & (p - slot_pos[None, :] < window)
            ring_visible &= active[:, None]
            new_dist = positions[:, None] - positions[None, :]
            visible = np.concatenate([ring_visible, new_visible & (new_dist < window) & (new_dist >= 0)], axis=1)
            out[f"mask_{SHORT[t]}"] = np.where(visible, np.float32(0), self.mask_negative).astype(np.float32)
        return out


# --- one pass's feeds ---------------------------------------------------------------------------


def build_feeds(embed: EmbeddingLut, per_layer: EmbeddingLut | None, rope: Rope, ring: KVRing,
                token_ids, positions, ancestors, active=None, num_layers: int = 0) -> dict[str, np.ndarray]:
    """Every input of one graph pass: LUT rows, rotary tables, masks and rings.

    Padding rows (`active` False) get token 0 and position 0; they see only themselves and
    their outputs are to be ignored."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    active = np.ones(len(token_ids), dtype=bool) if active is None else np.asarray(active, dtype=bool)
    token_ids, positions = np.where(active, token_ids, 0), np.where(active, positions, 0)
    feeds = {"embeds": embed.lookup(token_ids)}
    if per_layer is not None:
        # the per-layer table packs all layers in one row: [n, layers * width] -> [n, layers, width]
        feeds["per_layer_embeds"] = per_layer.lookup(token_ids).reshape(len(token_ids), num_layers, -1)
    for layer_type in ring.slots:
        cos, sin = rope.tables(layer_type, positions)
        feeds[f"cos_{SHORT[layer_type]}"], feeds[f"sin_{SHORT[layer_type]}"] = cos, sin
    feeds.update(ring.masks(positions, ancestors, active))
    feeds.update(ring.feeds())
    return feeds


class SlmHost:
    """The phone's host loop around the SLM's tree and prefill graphs, which share one KV ring:
    each pass's feeds from the LUTs, rotary tables, ring and masks (io_spec's names and shapes),
    the pass itself, and the ring written back with the rows the caller commits. `specs` and
    `sessions` are keyed "tree" and "prefill"; a session has onnxruntime's `run(names, feeds)`."""

    def __init__(self, specs: dict[str, Any], sessions: dict[str, Any], luts: Path, rope: Rope):
        self.specs, self.sessions, self.rope = specs, sessions, rope
        meta = specs["tree"].meta
        self.ring = KVRing.from_meta(meta)
        self.num_layers = int(meta["num_layers"])
        self.embed = EmbeddingLut.open(Path(luts) / "embed_tokens.safetensors")
        per_layer = Path(luts) / "embed_tokens_per_layer.safetensors"
        self.per_layer = EmbeddingLut.open(per_layer) if per_layer.is_file() else None

    def feeds(self, graph: str, tokens, positions, ancestors, active) -> dict[str, np.ndarray]:
        spec = self.specs[graph]
        self.ring.rows = spec.meta["rows"]  # one ring serves both graphs; only the row count differs
        feeds = build_feeds(self.embed, self.per_layer, self.rope, self.ring, tokens, positions, ancestors, active,
                            self.num_layers)
        inputs = {t.name for t in spec.inputs}
        feeds = {k: v for k, v in feeds.items() if k in inputs}
        spec.check_feeds(feeds)
        return feeds

    def run(self, graph: str, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        """One pass; `names`: the outputs to fetch (default: io_spec's)."""
        names = names or [t.name for t in self.specs[graph].outputs]
        return dict(zip(names, self.sessions[graph].run(names, feeds), strict=True))

    def write(self, outputs: dict[str, np.ndarray], rows, positions) -> None:
        self.ring.write(outputs, rows, positions)
