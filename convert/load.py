"""Reading the E2B QAT checkpoint: config checks, a completeness check, then transformers.

The completeness check is declarative: the tensors the checkpoint must hold are derived from
transformers' own Gemma 4 module tree (built on the meta device, so it costs nothing), with
each Linear / Embedding turned into its QAT-format tensors. Every checkpoint tensor is then
expected (shape and dtype checked), ignored on purpose (vision/audio towers, KV-cache scales,
which are recorded) or extra (listed in the report, e.g. k_proj/v_proj of KV-shared layers,
which transformers ignores silently). Only then is the model loaded with `from_pretrained`
(the GemmaQuantizer path).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyco.errors import HycoError

SUPPORTED_BITS = (2, 4, 8)
FLOAT_DTYPES = {"F32", "BF16", "F16"}


@dataclass(frozen=True)
class Layout:
    """Where the text model's weights sit in a checkpoint of a given architecture."""

    name: str
    text_prefix: str  # checkpoint prefix of Gemma4TextModel's tensors
    ignored_prefixes: tuple[str, ...] = ()  # towers the NPU graphs leave out


LAYOUTS = {
    "Gemma4ForCausalLM": Layout("text-only", "model."),
    "Gemma4ForConditionalGeneration": Layout(
        "multimodal", "model.language_model.",
        ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")),
}


@dataclass(frozen=True)
class Expect:
    shape: tuple[int, ...]
    dtypes: frozenset[str]
    required: bool = True
    blocks_of: int = 0  # block-wise scales: the last dim must divide this width


@dataclass
class Checkpoint:
    folder: Path
    config: dict[str, Any]  # config.json
    layout: Layout
    tensors: dict[str, tuple[str, tuple[int, ...], Path]]  # name -> (dtype, shape, file)
    bits: dict[str, int] = field(default_factory=dict)  # quantized module (checkpoint name) -> bits

    @property
    def quant(self) -> dict[str, Any]:
        return self.config.get("quantization_config") or {}


# --- safetensors headers -------------------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors header, with a check that the file holds all the bytes it declares."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise HycoError(f"{path}: not a readable safetensors file ({type(e).__name__})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > path.stat().st_size:
        raise HycoError(f"{path}: truncated ({path.stat().st_size} bytes, header declares {8 + n + end})")
    return header


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise HycoError(f"{index}: malformed index ({e})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise HycoError(f"{f}: listed in {index.name} but missing")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise HycoError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    return [single]


# --- config ---------------------------------------------------------------------------------------


def read_checkpoint(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HycoError(f"config.json not found in {folder}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise HycoError(f"{config_path}: not valid JSON ({e})") from None
    arch = (config.get("architectures") or [None])[0]
    if arch not in LAYOUTS:
        raise HycoError(f"{config_path}: architecture {arch!r} is not supported (supported: {', '.join(LAYOUTS)})")
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "gemma":
        raise HycoError(f"{config_path}: quantization_config.quant_method must be 'gemma' (the E2B QAT format), "
                        f"but got {quant.get('quant_method')!r}")
    check_bits(quant.get("num_bits", 4), f"{config_path}: quantization_config.num_bits")
    for pattern, override in (quant.get("module_quant_configs") or {}).items():
        check_bits(override.get("num_bits", quant.get("num_bits", 4)),
                   f"{config_path}: quantization_config.module_quant_configs[{pattern!r}].num_bits")
    tensors = {}
    for path in weight_files(folder):
        for name, info in read_header(path).items():
            if name != "__metadata__":
                tensors[name] = (info["dtype"], tuple(info["shape"]), path)
    return Checkpoint(folder, config, LAYOUTS[arch], tensors)


def check_bits(bits: Any, where: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise HycoError(f"{where} must be one of {list(SUPPORTED_BITS)}, but got {bits!r}")


def module_bits(name: str, quant: dict[str, Any]) -> int:
    """transformers' rule (replace_with_quant_layers): one alternation of the patterns,
    searched in the module name; among matches at the same position the first listed wins."""
    configs = quant.get("module_quant_configs") or {}
    default = quant.get("num_bits", 4)
    if not configs:
        return default
    matcher = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(configs)))
    match = matcher.search(name)
    if match is None:
        return default
    group = next(g for g, v in match.groupdict().items() if v is not None)
    return list(configs.values())[int(group[1:])].get("num_bits", default)


def text_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder)).get_text_config()


# --- the declarative name map ----------------------------------------------------------------------


def expected_tensors(ckpt: Checkpoint) -> dict[str, Expect]:
    """Checkpoint name -> expected shape/dtype, from transformers' module tree on the meta device."""
    import torch
    from torch import nn
    from transformers import Gemma4ForCausalLM

    tc = text_config(ckpt.folder)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(tc)
    quantize_embeddings = bool(ckpt.quant.get("quantize_embeddings", False))
    skip = set(ckpt.quant.get("modules_to_not_convert") or [])

    def checkpoint_name(name: str) -> str:  # Gemma4ForCausalLM name -> this layout's name
        return ckpt.layout.text_prefix + name[len("model."):] if name.startswith("model.") else name

    expect: dict[str, Expect] = {}
    quantized_modules = set()
    for name, module in model.named_modules():
        cname = checkpoint_name(name)
        is_linear, is_embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
        if not (is_linear or (is_embedding and quantize_embeddings)) or cname in skip:
            continue
        bits = module_bits(cname, ckpt.quant)
        ckpt.bits[cname] = bits
        quantized_modules.add(name)
        rows, width = (module.out_features, module.in_features) if is_linear else (module.num_embeddings, module.embedding_dim)
        per_byte = 8 // bits
        packed = (rows, math.ceil(width / per_byte))
        int_dtype = frozenset({"I8"} if bits == 8 else {"U8"})
        if is_linear:
            expect[f"{cname}.weight"] = Expect(packed, int_dtype)
            expect[f"{cname}.weight_scale"] = Expect((rows, 1), frozenset({"F32"}))
            for which in ("input_activation_scale", "output_activation_scale"):
                expect[f"{cname}.{which}"] = Expect((), frozenset({"F32"}), required=False)
        else:
            expect[f"{cname}.embedding_quantized"] = Expect(packed, int_dtype)
            expect[f"{cname}.embedding_scale"] = Expect((rows, -1), frozenset({"F32"}), blocks_of=width)
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in quantized_modules:
            continue
        expect[checkpoint_name(name)] = Expect(tuple(tensor.shape), frozenset(FLOAT_DTYPES))
    return expect


def completeness(ckpt: Checkpoint) -> dict[str, Any]:
    """Compare the checkpoint with the name map; raise on missing or misshapen tensors."""
    expect = expected_tensors(ckpt)
    report: dict[str, Any] = {"layout": ckpt.layout.name, "tensors": len(ckpt.tensors), "missing": [],
                              "misshapen": [], "extra": [], "ignored_towers": 0, "kv_cache_scales": []}
    for name, e in expect.items():
        if name not in ckpt.tensors:
            if e.required:
                report["missing"].append(name)
            continue
        dtype, shape, path = ckpt.tensors[name]
        ok_shape = len(shape) == len(e.shape) and all(x == y or y == -1 for x, y in zip(shape, e.shape, strict=True))
        if e.blocks_of and ok_shape:  # block-wise embedding scales: blocks must tile the row
            ok_shape = shape[-1] >= 1 and e.blocks_of % shape[-1] == 0
        if not ok_shape or dtype not in e.dtypes:
            report["misshapen"].append(f"{name}: expected {sorted(e.dtypes)}{list(e.shape)}, got {dtype}{list(shape)} in {path.name}")
    for name in sorted(set(ckpt.tensors) - set(expect)):
        if name.endswith(("k_cache_scale", "v_cache_scale")):
            report["kv_cache_scales"].append(name)
        elif name.startswith(ckpt.layout.ignored_prefixes):
            report["ignored_towers"] += 1
        else:
            report["extra"].append(name)
    if report["missing"]:
        raise HycoError(f"{ckpt.folder}: missing tensor {report['missing'][0]} "
                        f"({len(report['missing'])} missing: {', '.join(report['missing'][:5])})")
    if report["misshapen"]:
        raise HycoError(f"{ckpt.folder}: misshapen tensor {report['misshapen'][0]}")
    return report


# --- loading through transformers ------------------------------------------------------------------


def load_model(ckpt: Checkpoint):
    """(text model, lm_head) through `from_pretrained` on the local folder (GemmaQuantizer path),
    in float32 activations so the graphs and the parity reference share one dtype."""
    import torch
    import transformers

    cls = getattr(transformers, (ckpt.config.get("architectures") or [""])[0])
    try:
        model = cls.from_pretrained(str(ckpt.folder), dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise HycoError(f"{ckpt.folder}: transformers could not load the checkpoint ({str(e).splitlines()[0]})") from None
    model.eval()
    text = model.model.language_model if ckpt.layout.name == "multimodal" else model.model
    return model, text, model.lm_head


def kv_cache_scales(ckpt: Checkpoint, names: list[str]) -> dict[str, float]:
    """k/v_cache_scale tensors (transformers reads and drops them); calibrate/ reads them here."""
    from safetensors import safe_open

    out = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(ckpt.tensors[n][2], []).append(n)
    for path, ns in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for n in ns:
                out[n] = float(f.get_tensor(n).float().reshape(-1)[0])
    return out
