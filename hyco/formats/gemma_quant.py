"""The Gemma QAT-mobile weight format: packing, quantization and reading, bit-exact.

transformers' `integrations/gemma_quant.py` unpacks what this module packs:
- int8: one signed value per int8 byte, stored as is;
- int4: two values per uint8 byte, the first in the low nibble, each stored as value + 8;
- int2: four values per uint8 byte, the first in bits [1:0], each stored as value + 2.
Scales are float32, one per output row (`weight_scale [out, 1]`, `embedding_scale [rows, 1]`),
and the dequantized weight is `int * scale`. SRQ activation scales are float32 scalars, 0 = off.

`module_quant_configs` is one regex alternation searched in each module name (transformers'
`replace_with_quant_layers`), so the match that starts LEFTMOST in the name wins, and only among
matches starting at the same place does the pattern listed first win (`bits_for_module` is that
rule, for every stage): `embed_tokens_per_layer` must come before `embed_tokens`, and on
`layers.1.mlp.down_proj` a pattern for `layers.1.` beats one for `mlp.down_proj` wherever listed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from hyco.base.errors import HycoError

SUPPORTED_BITS = (2, 4, 8)
VALUES_PER_BYTE = {2: 4, 4: 2, 8: 1}


def int_range(bits: int) -> tuple[int, int]:
    check_bits(bits, "num_bits")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def check_bits(bits: int, where: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise HycoError(f"{where}: unsupported bit width {bits!r} (supported: 2, 4, 8)")


def packed_width(width: int, bits: int) -> int:
    per_byte = VALUES_PER_BYTE[bits]
    return (width + per_byte - 1) // per_byte


def pack(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integers [..., width] -> the checkpoint's storage tensor (int8, or uint8 packed)."""
    lo, hi = int_range(bits)
    ints = ints.to(torch.int16)
    if ints.numel() and (int(ints.min()) < lo or int(ints.max()) > hi):
        raise HycoError(f"pack: values outside the int{bits} range [{lo}, {hi}]")
    if bits == 8:
        return ints.to(torch.int8).contiguous()
    per_byte = VALUES_PER_BYTE[bits]
    width = ints.shape[-1]
    pad = packed_width(width, bits) * per_byte - width
    # Padding values are stored as the offset itself (value 0); the loader slices them off.
    stored = torch.nn.functional.pad(ints - lo, (0, pad)).to(torch.uint8)
    stored = stored.reshape(*ints.shape[:-1], -1, per_byte)
    packed = torch.zeros(stored.shape[:-1], dtype=torch.uint8)
    for slot in range(per_byte):
        packed |= stored[..., slot] << (bits * slot)
    return packed.contiguous()


def unpack(stored: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """The checkpoint's storage tensor -> signed integers [..., width] (int8)."""
    check_bits(bits, "unpack")
    if bits == 8:
        return stored.to(torch.int8)[..., :width]
    per_byte = VALUES_PER_BYTE[bits]
    lo, _ = int_range(bits)
    raw = stored.to(torch.uint8)
    mask = (1 << bits) - 1
    slots = [((raw >> (bits * slot)) & mask).to(torch.int8) + lo for slot in range(per_byte)]
    return torch.stack(slots, dim=-1).reshape(*raw.shape[:-1], -1)[..., :width]


def quantize_rows(weight: torch.Tensor, bits: int, ratios: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: (ints [rows, cols] int8, scale [rows, 1] float32).

    The scale of each row is `ratio * absmax / qmax`, with the ratio chosen per row from
    `ratios` by least squared error: at 2 bits the plain absmax scale leaves most weights at 0,
    and clipping a few outliers costs far less than that.
    """
    lo, hi = int_range(bits)
    w = weight.detach().float()
    if ratios is None:
        ratios = torch.linspace(1.0, 0.3, 15)
    absmax = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
    best_err = torch.full_like(absmax, float("inf"))
    best_scale = absmax / hi
    for r in ratios.tolist():
        scale = (r * absmax / hi).float()
        err = ((torch.clamp(torch.round(w / scale), lo, hi) * scale - w) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
    ints = torch.clamp(torch.round(w / best_scale), lo, hi).to(torch.int8)
    return ints, best_scale.float().contiguous()


def quantize_blocks(weight: torch.Tensor, bits: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` on each of a row's `blocks` equal slices: (ints [rows, cols], scale
    [rows, blocks]), E2B's per-layer table (one scale per layer's slice of a token's row)."""
    rows, cols = weight.shape
    if cols % blocks:
        raise HycoError(f"quantize_blocks: {blocks} blocks do not tile rows of {cols}")
    ints, scale = quantize_rows(weight.reshape(rows * blocks, cols // blocks), bits)
    return ints.reshape(rows, cols), scale.reshape(rows, blocks)


def dequantize(ints: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int x scale in float32, the same product transformers' loader computes; a scale of
    [rows, blocks] applies to each of a row's `blocks` equal slices."""
    blocks = scale.shape[-1]
    if blocks == 1:
        return ints.to(torch.float32) * scale.to(torch.float32)
    rows, cols = ints.shape
    return (ints.to(torch.float32).reshape(rows, blocks, -1) * scale.to(torch.float32)[..., None]).reshape(rows, cols)


def bits_for_module(name: str, module_quant_configs: Mapping[str, Mapping] | None, default_bits: int) -> int:
    """The bit width transformers gives module `name`: its patterns joined into one alternation
    of named groups and searched once, so the leftmost match wins (ties: the first listed)."""
    configs = module_quant_configs or {}
    if not configs:
        return default_bits
    match = re.search("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(configs)), name)
    if match is None:
        return default_bits
    group = next(g for g, v in match.groupdict().items() if v is not None)
    return int(list(configs.values())[int(group[1:])].get("num_bits", default_bits))


# --- reading a QAT checkpoint folder ------------------------------------------------------


class QatCheckpoint:
    """Lazy, tensor-by-tensor access to a QAT-mobile checkpoint folder (sharded or not).

    Only the tensors asked for are read, so a multi-GB checkpoint is never held whole.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise HycoError(f"config.json not found in {self.folder}")
        self.config = json.loads(config_path.read_text())
        qc = self.config.get("quantization_config") or {}
        if qc.get("quant_method") != "gemma":
            raise HycoError(f"{config_path}: quantization_config.quant_method must be 'gemma', "
                            f"but got {qc.get('quant_method')!r}")
        self.quant_config = qc
        self.default_bits = int(qc.get("num_bits", 4))
        check_bits(self.default_bits, f"{config_path}: quantization_config.num_bits")
        for pattern, override in (qc.get("module_quant_configs") or {}).items():
            check_bits(int(override.get("num_bits", self.default_bits)),
                       f"{config_path}: module_quant_configs[{pattern!r}].num_bits")
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.folder / "model.safetensors"
        if not single.is_file():
            raise HycoError(f"no model.safetensors or model.safetensors.index.json in {self.folder}")
        return {k: single.name for k in _open_safetensors(single).keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        if name not in self.weight_map:
            raise HycoError(f"{self.folder}: tensor {name!r} not in the checkpoint")
        path = self.folder / self.weight_map[name]
        if path.name not in self._handles:
            self._handles[path.name] = _open_safetensors(path)
        try:
            return self._handles[path.name].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise HycoError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def bits(self, module: str) -> int:
        return bits_for_module(module, self.quant_config.get("module_quant_configs"), self.default_bits)

    def linear(self, module: str, in_features: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ints [out, in] int8, weight_scale [out, 1] float32, bits) of a QuantizedLinear."""
        bits = self.bits(module)
        stored = self.tensor(f"{module}.weight")
        self._check_storage(module + ".weight", stored, bits, in_features)
        scale = self.tensor(f"{module}.weight_scale").float()
        if tuple(scale.shape) != (stored.shape[0], 1):
            raise HycoError(f"{self.folder}: tensor {module}.weight_scale has shape {tuple(scale.shape)}, "
                            f"expected ({stored.shape[0]}, 1)")
        return unpack(stored, bits, in_features), scale, bits

    def embedding(self, module: str, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ints [rows, dim] int8, embedding_scale [rows, blocks] float32, bits) of a
        QuantizedEmbedding; blocks equal slices of a row share a scale (E2B's per-layer table)."""
        bits = self.bits(module)
        stored = self.tensor(f"{module}.embedding_quantized")
        self._check_storage(module + ".embedding_quantized", stored, bits, dim)
        scale = self.tensor(f"{module}.embedding_scale").float()
        if scale.ndim != 2 or scale.shape[0] != stored.shape[0] or dim % scale.shape[1]:
            raise HycoError(f"{self.folder}: tensor {module}.embedding_scale has shape {tuple(scale.shape)}, "
                            f"expected ({stored.shape[0]}, blocks) with blocks dividing {dim}")
        return unpack(stored, bits, dim), scale, bits

    def activation_scales(self, module: str) -> tuple[float, float]:
        """SRQ (input, output) scales of a linear; 0.0 where absent or off."""
        def scalar(name: str) -> float:
            return float(self.tensor(name)) if name in self else 0.0

        return scalar(f"{module}.input_activation_scale"), scalar(f"{module}.output_activation_scale")

    def _check_storage(self, name: str, stored: torch.Tensor, bits: int, width: int) -> None:
        want_dtype = torch.int8 if bits == 8 else torch.uint8
        want_width = packed_width(width, bits)
        if stored.dtype != want_dtype or stored.ndim != 2 or stored.shape[1] != want_width:
            raise HycoError(f"{self.folder}: tensor {name} is {stored.dtype} {tuple(stored.shape)}, but int{bits} "
                            f"storage of width {width} is {want_dtype} [rows, {want_width}]")


def _open_safetensors(path: Path):
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise HycoError(f"checkpoint shard not found: {path}")
    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError) as e:
        raise HycoError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None
