"""Gemma 4 QAT-mobile checkpoints in compressed-tensors' pack-quantized layout (`-ct`, what vLLM
users download), read as the `-transformers` layout (quant_method "gemma") every stage reads.

The two layouts hold the same ints and scales:

| `-transformers` (hyco/formats/gemma_quant.py)              | `-ct` (compressed-tensors, pack-quantized)           |
|----------------------------------------------------|------------------------------------------------------|
| `M.weight` int8 / uint8 packed (2, 4 per byte)     | `M.weight_packed` int32, `pack_to_int32` (dense bits) |
| `M.weight_scale` [out, 1]                          | `M.weight_scale` [out, 1] (strategy channel)          |
| `E.embedding_quantized`, `E.embedding_scale` [r, b] | `E.weight_packed`, `E.weight_scale` [r, b] (group)    |
| (width implied)                                    | `M.weight_shape` [rows, cols]                         |
| `M.input_activation_scale`, `.output_activation_scale` | `M.input_scale`, `M.output_scale` (static)        |
| `A.k_cache_scale`, `A.v_cache_scale`               | `A.k_scale`, `A.v_scale` (kv_cache_scheme)            |
| `module_quant_configs` (leftmost regex wins)       | `config_groups` targets (exact, `re:`, class names)   |
| `modules_to_not_convert`                           | `ignore`                                              |

Google's `-ct` files are not reachable from here; this is the mapping compressed-tensors 0.20's own
compressor and matcher define (`pack_to_int32`, `match_targets`), which our `-ct` fixtures are
written with (`write_ct`). `gemma_layout(folder)` transcodes a `-ct` folder once, shard by shard,
into a cache keyed by its files' sha256, and proves every module's ints and scales equal in both
before the folder is used; a `-transformers` folder is returned as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from hyco.base.errors import HycoError

CT_METHOD = "compressed-tensors"
RENAMED = {".input_activation_scale": ".input_scale", ".output_activation_scale": ".output_scale",
           ".k_cache_scale": ".k_scale", ".v_cache_scale": ".v_scale"}
INDEX = "model.safetensors.index.json"
STATIC_8BIT = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}


def is_ct(folder: Path) -> bool:
    """Whether `folder`'s config.json names the compressed-tensors method (a missing config is
    not: the reader after this one says what is missing; a malformed one fails here by name)."""
    from hyco.base.loading import read_json

    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    data = read_json(config, "config.json")
    quant = (data.get("quantization_config") if isinstance(data, dict) else None) or {}
    return quant.get("quant_method") == CT_METHOD


def _shards(folder: Path) -> dict[str, list[str]]:
    """Shard file -> its tensor names (the index's, or the one file's)."""
    from safetensors import safe_open

    index = folder / INDEX
    if index.is_file():
        by_file: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        return by_file
    if not (folder / "model.safetensors").is_file():
        raise HycoError(f"no model.safetensors or {INDEX} in {folder}")
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {"model.safetensors": list(f.keys())}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _copy_side_files(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", INDEX):
            shutil.copyfile(p, dst / p.name)


# --- -transformers -> -ct (fixtures) --------------------------------------------------------------


def write_ct(gemma: Path, out: Path) -> None:
    """The `-transformers` checkpoint `gemma` written again in the `-ct` layout into `out` (same
    shards, same tensor order), each module's ints packed by compressed-tensors' own
    `pack_to_int32`."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from hyco.formats.gemma_quant import QatCheckpoint, unpack

    gemma, out = Path(gemma), Path(out)
    ckpt = QatCheckpoint(gemma)
    names = set(ckpt.weight_map)
    # module -> (its ints' tensor, its scales' tensor): linears, then the quantized embeddings
    packed = {n.removesuffix(".weight_scale"): ("weight", "weight_scale") for n in names if n.endswith(".weight_scale")}
    packed |= {n.removesuffix(".embedding_scale"): ("embedding_quantized", "embedding_scale")
               for n in names if n.endswith(".embedding_scale")}
    groups: dict[tuple, list[str]] = {}
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, tensor_names in _shards(gemma).items():
        tensors = {}
        for name in tensor_names:
            module, _, leaf = name.rpartition(".")
            if leaf not in packed.get(module, ()):
                renamed = next((name[:-len(s)] + t for s, t in RENAMED.items() if name.endswith(s)), name)
                tensors[renamed] = ckpt.tensor(name)
                continue
            ints_name, scale_name = packed[module]
            if leaf == scale_name:
                continue  # written with its ints
            bits, scale, stored = ckpt.bits(module), ckpt.tensor(f"{module}.{scale_name}"), ckpt.tensor(name)
            ints = unpack(stored, bits, stored.shape[1] * (8 // bits))  # the packed width, padding included
            tensors[f"{module}.weight_packed"] = pack_to_int32(ints, bits)
            tensors[f"{module}.weight_scale"] = scale
            tensors[f"{module}.weight_shape"] = torch.tensor(ints.shape)
            blocks = scale.shape[1]  # an embedding's row may hold several scale blocks (E2B's per-layer table)
            strategy = ("channel", None) if blocks == 1 else ("group", ints.shape[1] // blocks)
            groups.setdefault((bits, *strategy, f"{module}.input_activation_scale" in names), []).append(module)
        _save(tensors, out / file)
        weight_map.update(dict.fromkeys(tensors, file))
    config = json.loads((gemma / "config.json").read_text())
    gq = config["quantization_config"]
    config_groups = {}
    for i, ((bits, strategy, group_size, srq), modules) in enumerate(sorted(groups.items(), key=str)):
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy, "group_size": group_size,
                   "dynamic": False}
        group = {"targets": sorted(modules), "weights": weights}
        if srq:
            group.update(input_activations=STATIC_8BIT, output_activations=STATIC_8BIT)
        config_groups[f"group_{i}"] = group
    kv = any(n.endswith(".k_cache_scale") for n in names)
    config["quantization_config"] = {
        "quant_method": CT_METHOD, "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": config_groups, "ignore": list(gq.get("modules_to_not_convert") or []),
        "kv_cache_scheme": STATIC_8BIT if kv else None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(gemma, out)
    if (gemma / INDEX).is_file():
        (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


# --- -ct -> -transformers (what every stage reads) ------------------------------------------------


def module_kinds(config: dict, folder: Path) -> dict[str, torch.nn.Module]:
    """Module name -> module of the checkpoint's architecture, built on the meta device (no
    weights): compressed-tensors matches class-name targets against it, and it tells an
    embedding's packed table from a linear's."""
    import transformers
    from transformers import AutoConfig

    from hyco.config.families import architecture

    arch = architecture(config)
    cls = getattr(transformers, arch or "", None)
    if cls is None:
        raise HycoError(f"{folder / 'config.json'}: architecture {arch!r} is not a transformers class")
    cfg = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = cls(cfg)
    return dict(model.named_modules())


def group_of(name: str, module, config_groups: dict) -> dict | None:
    """The config group compressed-tensors gives module `name` (its `match_targets`: exact names,
    then `re:` patterns, then class names; the first group holding the best match)."""
    from compressed_tensors.utils.match import match_targets

    best = None
    for group in config_groups.values():
        found = match_targets(name, module, group.get("targets") or [])
        if found:
            rank = (0 if not found[0].startswith("re:") and found[0] == name else 1 if found[0].startswith("re:") else 2)
            if best is None or rank < best[0]:
                best = (rank, group)
    return None if best is None else best[1]


def to_gemma(ct: Path, out: Path) -> dict[str, int]:
    """Write the `-ct` checkpoint `ct` in the `-transformers` layout into `out`; per module its bit
    width (the config's `module_quant_configs`: one exact pattern a module)."""
    from hyco.formats.gemma_quant import check_bits, pack

    ct, out = Path(ct), Path(out)
    config = json.loads((ct / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("format") != "pack-quantized":
        raise HycoError(f"{ct / 'config.json'}: compressed-tensors format {quant.get('format')!r}; the Gemma QAT "
                        "`-ct` checkpoints are pack-quantized")
    groups = quant.get("config_groups") or {}
    modules = module_kinds(config, ct)
    shards = _shards(ct)
    out.mkdir(parents=True, exist_ok=True)
    bits_of: dict[str, int] = {}
    embeddings = set()
    weight_map = {}
    from safetensors import safe_open

    for file, tensor_names in shards.items():
        tensors = {}
        with safe_open(ct / file, "pt") as f:
            for name in tensor_names:
                module, _, leaf = name.rpartition(".")
                if leaf in ("weight_shape", "weight_scale") and f"{module}.weight_packed" in tensor_names:
                    continue
                if leaf != "weight_packed":
                    renamed = next((name[:-len(t)] + s for s, t in RENAMED.items() if name.endswith(t)), name)
                    tensors[renamed] = f.get_tensor(name)
                    continue
                # a module the architecture does not build (the KV-shared layers' k_proj / v_proj,
                # which transformers ignores too) is a Linear, as everything packed but embeddings
                kind = modules.get(module) or torch.nn.Linear(1, 1, device="meta")
                group = group_of(module, kind, groups)
                if group is None:
                    raise HycoError(f"{ct / 'config.json'}: no config group targets module {module!r} (tensor {name!r})")
                bits = int(group["weights"]["num_bits"])
                check_bits(bits, f"{ct / 'config.json'}: the group of {module!r} num_bits")
                if not group["weights"].get("symmetric", True):
                    raise HycoError(f"{ct / 'config.json'}: module {module!r} is asymmetric; the Gemma QAT format "
                                    "is symmetric (no zero points)")
                ints = _ints(f, module, bits, ct / file, tensor_names)
                scale = f.get_tensor(f"{module}.weight_scale").to(torch.float32)
                bits_of[module] = bits
                if isinstance(kind, torch.nn.Embedding):
                    embeddings.add(module)
                    tensors[f"{module}.embedding_quantized"] = pack(ints, bits)
                    tensors[f"{module}.embedding_scale"] = scale
                else:
                    tensors[f"{module}.weight"] = pack(ints, bits)
                    tensors[f"{module}.weight_scale"] = scale
        _save(tensors, out / file)
        weight_map.update(dict.fromkeys(tensors, file))
    counts = {b: list(bits_of.values()).count(b) for b in set(bits_of.values())}
    default = max(counts, key=counts.get) if counts else 4
    config["quantization_config"] = {
        "quant_method": "gemma", "num_bits": default, "quantize_embeddings": bool(embeddings),
        "module_quant_configs": {f"^{re.escape(m)}$": {"num_bits": b} for m, b in sorted(bits_of.items()) if b != default},
        "modules_to_not_convert": list(quant.get("ignore") or [])}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(ct, out)
    if (ct / INDEX).is_file():
        (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return bits_of


def _ints(f, module: str, bits: int, path: Path, names: list[str]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if f"{module}.weight_shape" not in names or f"{module}.weight_scale" not in names:
        raise HycoError(f"{path}: module {module!r} has weight_packed but no weight_shape / weight_scale")
    packed, shape = f.get_tensor(f"{module}.weight_packed"), f.get_tensor(f"{module}.weight_shape")
    rows, cols = (int(x) for x in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols * bits // 32)):
        raise HycoError(f"{path}: tensor {module}.weight_packed is {packed.dtype} {tuple(packed.shape)}, but {bits}-bit "
                        f"packing of [{rows}, {cols}] is int32 [{rows}, {-(-cols * bits // 32)}]")
    return unpack_from_int32(packed, bits, torch.Size([rows, cols]))


def prove_same(ct: Path, gemma: Path, bits_of: dict[str, int]) -> None:
    """Every packed module's ints (compressed-tensors' unpack of the `-ct` file) and scales equal the
    `-transformers` folder's (hyco/formats/gemma_quant.py's unpack), tensor by tensor; and every other tensor
    is the same bytes."""
    from safetensors import safe_open

    from hyco.formats.gemma_quant import QatCheckpoint

    ckpt = QatCheckpoint(gemma)
    for file, names in _shards(ct).items():
        with safe_open(ct / file, "pt") as f:
            for name in names:
                module, _, leaf = name.rpartition(".")
                if leaf == "weight_packed":
                    bits = bits_of[module]
                    ints = _ints(f, module, bits, ct / file, names)
                    if f"{module}.embedding_quantized" in ckpt:
                        theirs, scale, _ = ckpt.embedding(module, ints.shape[1])
                    else:
                        theirs, scale, _ = ckpt.linear(module, ints.shape[1])
                    same = torch.equal(ints, theirs) and torch.equal(
                        f.get_tensor(f"{module}.weight_scale").to(torch.float32), scale)
                elif leaf in ("weight_shape", "weight_scale") and f"{module}.weight_packed" in names:
                    continue
                else:
                    renamed = next((name[:-len(t)] + s for s, t in RENAMED.items() if name.endswith(t)), name)
                    same = torch.equal(f.get_tensor(name), ckpt.tensor(renamed))
                if not same:
                    raise HycoError(f"{ct / file}: tensor {name!r} does not read back equal in the -transformers "
                                    f"layout written to {gemma}")


def cache_root() -> Path:
    return Path(os.environ.get("HYCO_CACHE", Path.home() / ".cache" / "hyco-convert")) / "gemma-layout"


def gemma_layout(folder: Path) -> Path:
    """`folder` when it is in the `-transformers` layout; for a `-ct` folder, its transcode (made
    once, proven, cached by the sha256 of its files)."""
    import hashlib

    from hyco.base.files import sha256_file

    folder = Path(folder)
    if not is_ct(folder):
        return folder
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(sha256_file(p).encode())
    final = cache_root() / h.hexdigest()[:16]
    if (final / "config.json").is_file():
        return final
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        bits_of = to_gemma(folder, tmp)
        prove_same(folder, tmp, bits_of)
        final.parent.mkdir(parents=True, exist_ok=True)
        if not final.exists():
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
