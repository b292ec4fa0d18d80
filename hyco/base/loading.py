"""Reading a stage's inputs: one place where library errors become HycoError.

safetensors, transformers, tokenizers, numpy, json and yaml each fail on bad input in their own
way (SafetensorError, OSError, ValueError, a KeyError deep inside a loader...). Every stage reads
its inputs through these functions, so a truncated shard, a header that lies, a tensor of the
wrong dtype or shape, NaN weights or a broken config all end the same way: one HycoError that
names the file and, where there is one, the tensor; the CLI prints it on one line and exits 2.

Checks are cheap before they are thorough: safetensors headers (a few KB per shard) are read
and checked against the file size first; tensors are read one at a time; the finiteness check
runs on the loaded parameters (one pass over memory, no second copy).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError

# safetensors dtype -> bytes per element (the format's spec)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _library_errors() -> tuple[type[BaseException], ...]:
    """What the loaders raise on bad files (never a programming error of ours: no AttributeError)."""
    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, IndexError, RuntimeError, TypeError, EOFError, UnicodeDecodeError,
            SafetensorError)


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


# --- json, jsonl, yaml, npy ---------------------------------------------------------------------


def read_json(path: str | Path, what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise HycoError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HycoError(f"{path}: cannot read ({one_line(e)})") from None


def read_jsonl(path: str | Path, what: str = "file") -> list[Any]:
    """Every line of a JSON-lines file the stages wrote (prompts, answers): a bad line is an error
    naming the file and the line (such files are ours; a cut one is not silently shortened)."""
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{what} not found: {path}")
    records = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HycoError(f"{path}: cannot read ({one_line(e)})") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise HycoError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    return records


def read_yaml(path: str | Path, what: str = "file") -> Any:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{what} not found: {path}")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise HycoError(f"{path}: malformed YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HycoError(f"{path}: cannot read ({one_line(e)})") from None


def load_npy(path: str | Path, dtype, shape: tuple[int, ...] | None = None, what: str = "array"):
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{what} not found: {path}")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise HycoError(f"{path}: not a readable .npy ({one_line(e)})") from None
    if array.dtype != np.dtype(dtype) or (shape is not None and array.shape != tuple(shape)):
        want = f"{np.dtype(dtype).name}{list(shape) if shape is not None else ''}"
        raise HycoError(f"{path}: must be {want}, but got {array.dtype}{list(array.shape)}")
    return array


# --- safetensors --------------------------------------------------------------------------------


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The header of a safetensors file, checked whole: JSON, every entry's dtype, shape and byte
    span, and that the file holds every byte the header declares. Tensor name -> entry."""
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"safetensors file not found: {path}")
    size = path.stat().st_size
    if size < 8:
        raise HycoError(f"{path}: empty or truncated safetensors file ({size} bytes, no header)")
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, _MAX_HEADER):
                raise HycoError(f"{path}: corrupt or truncated safetensors header (declares {n} header bytes, "
                                f"the file has {size})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HycoError(f"{path}: corrupt safetensors header ({one_line(e)})") from None
    if not isinstance(header, dict):
        raise HycoError(f"{path}: corrupt safetensors header (not a JSON object)")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HycoError(f"{path}: tensor {name!r}: corrupt header entry {info!r:.120}") from None
        if dtype not in DTYPE_BYTES:
            raise HycoError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise HycoError(f"{path}: tensor {name!r} is {dtype}{shape} but spans {end - begin} bytes in the header")
        if end > data:
            raise HycoError(f"{path}: truncated: tensor {name!r} ends at data byte {end}, the file holds {data}")
    return header


def open_safetensors(path: str | Path, framework: str = "pt"):
    """safetensors' lazy reader (also a context manager), after the header checks."""
    from safetensors import safe_open

    safetensors_header(path)
    try:
        return safe_open(str(path), framework=framework)
    except _library_errors() as e:
        raise HycoError(f"{path}: not a readable safetensors file ({one_line(e)})") from None


def read_tensor(handle, name: str, path: str | Path):
    """One tensor of an open file; `path` is for the message."""
    try:
        return handle.get_tensor(name)
    except _library_errors() as e:
        raise HycoError(f"{path}: cannot read tensor {name!r} ({one_line(e)})") from None


def load_safetensors(path: str | Path, framework: str = "pt") -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors, metadata) of a whole (small) safetensors file: captures, LUTs, heads."""
    with open_safetensors(path, framework) as f:
        meta = f.metadata() or {}
        return {name: read_tensor(f, name, path) for name in f.keys()}, meta


def require_tensor(tensors: dict[str, Any], name: str, path: str | Path, dtype=None,
                   shape: tuple[int | None, ...] | None = None):
    """tensors[name], checked for presence, dtype and shape (None: any size on that axis)."""
    if name not in tensors:
        raise HycoError(f"{path}: tensor {name!r} is missing")
    t = tensors[name]
    got_shape = tuple(t.shape)
    if dtype is not None and t.dtype != dtype:
        raise HycoError(f"{path}: tensor {name!r} must be {dtype}, but got {t.dtype}")
    if shape is not None and (len(got_shape) != len(shape)
                              or any(w is not None and w != g for w, g in zip(shape, got_shape, strict=True))):
        want = [("*" if w is None else w) for w in shape]
        raise HycoError(f"{path}: tensor {name!r} must have shape {want}, but got {list(got_shape)}")
    return t


# --- checkpoint folders -------------------------------------------------------------------------


def checkpoint_files(folder: str | Path, what: str = "checkpoint") -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """Check a transformers checkpoint folder without loading it: config.json parses, the index
    (if any) parses and its shards exist, every shard's header is whole and the file is not cut,
    and every tensor the index names is in its shard. Tensor name -> (dtype, shape, file)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HycoError(f"{what} checkpoint not found: {folder}")
    config = read_json(folder / "config.json", f"{what} config.json")
    if not isinstance(config, dict):
        raise HycoError(f"{folder / 'config.json'}: must be a JSON object")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HycoError(f"{index}: no 'weight_map' of tensor -> shard")
        shards = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        weight_map, shards = None, ["model.safetensors"]
    else:
        raise HycoError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise HycoError(f"{path}: listed in {index.name} but missing")
        for name, info in safetensors_header(path).items():
            if name != "__metadata__":
                tensors[name] = (info["dtype"], tuple(info["shape"]), path)
    for name, shard in (weight_map or {}).items():
        if name not in tensors or tensors[name][2].name != shard:
            raise HycoError(f"{folder / shard}: tensor {name!r} is listed in {index.name} but not in this shard")
    return tensors


# Integer buffers a float checkpoint holds as integers: the centroid-masked assistant's vocabulary
# order (transformers keeps the buffer's int64; qat/mtp.py clusters_of checks it is a permutation).
INTEGER_BUFFERS = {"masked_embedding.token_ordering": frozenset({"I32", "I64"})}


def check_float_checkpoint(tensors: dict[str, tuple[str, tuple[int, ...], Path]], what: str) -> None:
    """A float checkpoint (verifier, assistant) holds float tensors only, but for its integer
    buffers (INTEGER_BUFFERS): transformers would cast an integer tensor to float without a word."""
    for name, (dtype, _, path) in sorted(tensors.items()):
        if dtype in INTEGER_BUFFERS.get(name, ()):
            continue
        if dtype not in FLOAT_DTYPES:
            raise HycoError(f"{path}: tensor {name!r} is {dtype}, but the {what} is a float checkpoint "
                            f"({', '.join(sorted(FLOAT_DTYPES))})")


QAT_SCALES = ("weight_scale", "embedding_scale", "input_activation_scale", "output_activation_scale",
              "k_cache_scale", "v_cache_scale")


def check_scales(tensors: dict[str, tuple[str, tuple[int, ...], Path]]) -> int:
    """QAT-format scales are finite; weight and embedding scales are positive (a zero scale zeroes
    a row, NaN poisons every logit); activation and KV-cache scales are >= 0 (0 = off). Reads only
    the scale tensors. Returns how many were checked."""
    import torch

    by_file: dict[Path, list[str]] = {}
    for name, (_, _, path) in tensors.items():
        if name.endswith(QAT_SCALES):  # not a model's own float parameters (per_dim_scale, router.scale)
            by_file.setdefault(path, []).append(name)
    for path, names in sorted(by_file.items()):
        with open_safetensors(path) as f:
            for name in sorted(names):
                t = read_tensor(f, name, path).float()
                if not bool(torch.isfinite(t).all()):
                    raise HycoError(f"{path}: tensor {name!r} holds NaN or Inf")
                positive = name.endswith(("weight_scale", "embedding_scale"))
                if bool((t <= 0).any()) if positive else bool((t < 0).any()):
                    raise HycoError(f"{path}: tensor {name!r} must be {'> 0' if positive else '>= 0'}, "
                                    f"but holds {float(t.min()):g}")
    return sum(len(v) for v in by_file.values())


def load_config(folder: str | Path, what: str = "model"):
    """transformers' AutoConfig of a local folder."""
    from transformers import AutoConfig

    folder = Path(folder)
    read_json(folder / "config.json", f"{what} config.json")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except _library_errors() as e:
        raise HycoError(f"{folder / 'config.json'}: transformers cannot read the {what} config ({one_line(e)})") from None


def quantized_tie(config: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...], Path]]) -> str | None:
    """How a QAT checkpoint's tie flag meets its files, where the token table is quantized:
    "stored" (tie_word_embeddings true but lm_head.weight stored, as Google's E2B QAT-mobile file
    ships: the file's own head is used, since transformers' tie would reach for
    embed_tokens.weight, which a QuantizedEmbedding does not have), "table" (tied and no lm_head:
    the head reads embed_tokens' quantized table), None (no quantized table, or untied)."""
    if not any(n.endswith("embed_tokens.embedding_quantized") for n in tensors):
        return None
    if not bool(config.get("tie_word_embeddings", True)):  # transformers' default is true
        return None
    return "stored" if "lm_head.weight" in tensors else "table"


def tied_quantized_class(cls):
    """`cls` whose tie maps lm_head's packed ints and row scales onto embed_tokens' quantized
    table, so transformers' own tie_weights shares the checkpoint's tensors. transformers ties
    lm_head.weight to embed_tokens.weight, which a QuantizedEmbedding does not have (a tied *and*
    quantized embedding crashes from_pretrained; platform notes)."""

    class TiedQuantized(cls):
        def tie_weights(self, missing_keys=None, recompute_mapping=False):
            keys = self.all_tied_weights_keys  # {target: source}, expanded at init for the float modules
            source = keys.get("lm_head.weight", "")
            if source.endswith("embed_tokens.weight") and hasattr(self.get_input_embeddings(), "embedding_quantized"):
                del keys["lm_head.weight"]
                table = source[: -len("weight")]
                keys["lm_head.weight"] = table + "embedding_quantized"
                keys["lm_head.weight_scale"] = table + "embedding_scale"
            return super().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)

    TiedQuantized.__name__ = TiedQuantized.__qualname__ = cls.__name__
    return TiedQuantized


def block_scaled_tables(tensors: dict[str, tuple[str, tuple[int, ...], Path]]) -> list[str]:
    """embedding_scale tensors with more than one block per row (E2B's per-layer table: one scale
    per layer's slice, [vocab, layers]), which transformers allocates as [V, 1] and refuses."""
    return sorted(n for n, (_, shape, _) in tensors.items()
                  if n.endswith(".embedding_scale") and len(shape) == 2 and shape[-1] > 1)


def set_block_scales(model, tensors: dict[str, tuple[str, tuple[int, ...], Path]], names: list[str]) -> None:
    """Each table's block scales from its file, in place of the [V, 1] transformers allocated
    (its QuantizedEmbedding dequantizes per block: width / blocks values share a scale)."""
    import torch

    for name in names:
        path = tensors[name][2]
        with open_safetensors(path) as f:
            scale = read_tensor(f, name, path).float()
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if module.embedding_dim % scale.shape[-1]:
            raise HycoError(f"{path}: tensor {name!r} has {scale.shape[-1]} blocks, which do not tile rows of "
                            f"{module.embedding_dim}")
        module.embedding_scale = torch.nn.Parameter(scale, requires_grad=False)


def share_tied_table(model, folder: str | Path) -> None:
    """After loading a tied quantized pair: lm_head holds embed_tokens' own table (not a copy)
    and unpacks it at the table's width."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is not embed.embedding_quantized or head.weight_scale is not embed.embedding_scale:
        raise HycoError(f"{folder}: tie_word_embeddings is true, but transformers did not tie lm_head to the "
                        "quantized embed_tokens table")
    head.num_bits = embed.num_bits


def srq_scales_off(model, missing_keys) -> set[str]:
    """Zero the SRQ scales a QAT file leaves out (off: the format's convention); transformers'
    init of a missing key would leave it at a random value. Returns their names."""
    import torch

    off = {k for k in missing_keys or [] if k.endswith(("input_activation_scale", "output_activation_scale"))}
    with torch.no_grad():
        for k in off:
            model.get_parameter(k).zero_()
    return off


MEDIA_PLACEHOLDERS = ("image_token_id", "video_token_id", "audio_token_id")
TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def tower_tensors(tensors: dict[str, tuple[str, tuple[int, ...], Path]]) -> dict[str, Any]:
    """The multimodal wrapper's vision and audio tensors, from the headers alone: what a
    text-only load leaves on disk (count and bytes, by tower)."""
    towers: dict[str, dict[str, int]] = {}
    for name, (dtype, shape, _) in tensors.items():
        prefix = next((p for p in TOWER_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            row = towers.setdefault(prefix.rstrip("."), {"tensors": 0, "bytes": 0})
            row["tensors"] += 1
            row["bytes"] += math.prod(shape) * DTYPE_BYTES[dtype]
    return {"tensors": sum(r["tensors"] for r in towers.values()), "bytes": sum(r["bytes"] for r in towers.values()),
            "by_tower": dict(sorted(towers.items()))}


def text_only_config(folder: str | Path, what: str = "model"):
    """The folder's config with the vision and audio towers switched off (None), so
    `from_pretrained(folder, config=...)` builds the wrapper around the text model alone and never
    reads the towers' tensors (they are unexpected keys, which transformers does not materialize).
    The text model keeps its names (`model.language_model.*`), so the file's quantization
    patterns match as written. None for a config without towers."""
    config = load_config(folder, what)
    if getattr(config, "vision_config", None) is None and getattr(config, "audio_config", None) is None:
        return None
    config.vision_config = None
    config.audio_config = None
    # With no towers the media placeholders stand for nothing: the wrapper would swap them for pad
    # before the embedding (they mark where tower outputs go); text-only they are ordinary tokens,
    # as in the NPU graphs' embedding LUT. -1 matches no id.
    for name in MEDIA_PLACEHOLDERS:
        if getattr(config, name, None) is not None:
            setattr(config, name, -1)
    return config


def untie(config) -> None:
    """The file's own lm_head instead of the tie (wrapper and text config alike): the tie would
    reach for embed_tokens.weight, which a QuantizedEmbedding does not have."""
    config.tie_word_embeddings = False
    config.get_text_config().tie_word_embeddings = False


def causal_lm_class(folder: str | Path):
    """The concrete class AutoModelForCausalLM would build for `folder`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(load_config(folder))]


@contextlib.contextmanager
def quiet_transformers():
    """transformers reports a missing or misshapen tensor as a multi-line warning table and goes on
    with random weights; our loaders refuse such tensors in one line, so its bar and report stay
    quiet while loading."""
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def load_pretrained(folder: str | Path, what: str, *, cls=None, float_checkpoint: bool = True,
                    check_finite: bool = True, **kwargs):
    """`cls.from_pretrained(folder, **kwargs)` (default AutoModelForCausalLM) on a checked local
    folder. Refuses what transformers would only warn about: a tensor missing from the
    checkpoint (it would be left at random init), one of the wrong shape, NaN or Inf weights.
    A multimodal checkpoint is loaded text-only (`text_only_config`): its towers stay on disk."""
    import torch

    if cls is None:
        from transformers import AutoModelForCausalLM as cls
    folder = Path(folder)
    tensors = checkpoint_files(folder, what)
    if float_checkpoint:
        check_float_checkpoint(tensors, what)
    tie = quantized_tie(read_json(folder / "config.json", f"{what} config.json"), tensors)
    blocks = block_scaled_tables(tensors)
    if "config" not in kwargs and (text_only := text_only_config(folder, what)) is not None:
        kwargs = {**kwargs, "config": text_only}
        tensors = {k: v for k, v in tensors.items() if not k.startswith(TOWER_PREFIXES)}
    if tie == "stored":
        untie(kwargs.setdefault("config", load_config(folder, what)))
    elif tie == "table":
        cls = tied_quantized_class(causal_lm_class(folder) if cls.__name__.startswith("Auto") else cls)
    narrow = _narrow_float_dtype(tensors)
    upcast = kwargs.get("dtype") is torch.float32 and narrow is not None
    if upcast:
        kwargs = {**kwargs, "dtype": narrow}
    try:
        # ignore_mismatched_sizes: hand back the misshapen tensors by name; refused just below
        with quiet_transformers():
            model, info = cls.from_pretrained(str(folder), output_loading_info=True,
                                              **{"ignore_mismatched_sizes": True, **kwargs})
    except _library_errors() as e:
        raise HycoError(f"{folder}: cannot load the {what} ({one_line(e)})") from None
    srq_off = set() if float_checkpoint else srq_scales_off(model, info.get("missing_keys"))
    set_block_scales(model, tensors, blocks)
    for key in ("missing_keys", "mismatched_keys"):
        bad = sorted(k for k in info.get(key) or [] if k not in srq_off and (k if isinstance(k, str) else k[0]) not in blocks)
        if bad:
            first = bad[0] if isinstance(bad[0], str) else bad[0][0]
            kind = "missing from" if key == "missing_keys" else "of the wrong shape in"
            shapes = "" if isinstance(bad[0], str) else f": {list(bad[0][1])}, the model needs {list(bad[0][2])}"
            raise HycoError(f"{folder}: tensor {first!r} is {kind} the {what} checkpoint{shapes} ({len(bad)} such)")
    if tie == "table":
        share_tied_table(model, folder)
    if upcast:
        upcast_to_float32(model)
    if check_finite:  # (weights accelerate offloaded to disk sit on the meta device: not read here)
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.device.type != "meta" and not all_finite(p):
                raise HycoError(f"{folder}: tensor {name!r} of the {what} holds NaN or Inf")
    return model


def all_finite(tensor, block: int = 1 << 22) -> bool:
    """torch.isfinite(tensor).all(), a block of elements at a time: on a whole tensor isfinite's
    temporaries outgrow the tensor itself (GBs over the 2,816-wide verifier's fp32 table)."""
    import torch

    with torch.no_grad():
        flat = tensor.detach().reshape(-1)
        return all(bool(torch.isfinite(part).all()) for part in flat.split(block))


def _narrow_float_dtype(tensors: dict[str, tuple[str, tuple[int, ...], Path]]):
    """torch.bfloat16 / float16 when every float tensor of the checkpoint is BF16 / F16, else None."""
    import torch

    floats = {dtype for dtype, _, _ in tensors.values() if dtype in FLOAT_DTYPES}
    return {"BF16": torch.bfloat16, "F16": torch.float16}.get(floats.pop()) if len(floats) == 1 else None


def upcast_to_float32(model) -> None:
    """A model loaded at its checkpoint's BF16/F16 -> the model `from_pretrained(dtype=float32)`
    gives, holding the fp32 weights once instead of several copies of them (for the 2,816-wide
    verifier stand-in, half the peak). Parameters are widened one at a time (exact: BF16 and F16
    are subsets of fp32). Buffers the model computes at init (embed_scale = sqrt(hidden), rotary
    frequencies; non-persistent) were computed at the narrow dtype (53.066 -> 53.0 in BF16), so
    they are taken from an fp32 skeleton whose parameters stay on the meta device; persistent
    buffers came from the checkpoint (a missing one is refused above) and are widened.
    tests/test_loading.py holds it equal to the fp32 load tensor by tensor."""
    import torch
    from accelerate import init_empty_weights

    from hyco.base.compat_torch import is_persistent_buffer
    from hyco.base.compat_transformers import skeleton_from_config

    with torch.no_grad():
        for param in model.parameters():  # tied parameters are one object: widened once
            if param.is_floating_point():
                param.data = param.data.float()
        with init_empty_weights(include_buffers=False):
            skeleton = skeleton_from_config(type(model), model.config, dtype=torch.float32)
        fresh = dict(skeleton.named_buffers())
        for name, buffer in list(model.named_buffers()):
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            persistent = is_persistent_buffer(module, leaf)
            value = (buffer.float() if buffer.is_floating_point() else buffer) if persistent else fresh[name]
            module.register_buffer(leaf, value.to(buffer.device), persistent=persistent)
    model.config.dtype = torch.float32


def load_tokenizer(folder: str | Path, what: str = "tokenizer", *, require_fast: bool = False):
    """A tokenizer from a local folder."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise HycoError(f"{what} folder not found: {folder}")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise HycoError(f"{what} not found: {folder / 'tokenizer.json'}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            read_json(folder / name, name)  # a cut file is named here, not deep inside tokenizers
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exception subclasses of its own
        raise HycoError(f"{folder}: cannot load the {what} ({one_line(e)})") from None
    if require_fast and not getattr(tokenizer, "is_fast", False):
        raise HycoError(f"{folder}: needs a fast tokenizer (tokenizer.json)")
    return tokenizer


def preflight(path: str | Path) -> None:
    """The cheap checks of an input folder that exists: a checkpoint's config, index and shard
    headers (no tensor read), a tokenizer's JSON files. A missing path is left to the stage that
    reads it; a dataset file is not read here (one cut mid-record is read up to its last record)."""
    path = Path(path)
    if not path.is_dir():
        return
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors*")):
        checkpoint_files(path, path.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            read_json(path / name, name)


# Quantized verifier formats transformers reads, and the packages its quantizers need to load them
# (transformers' quantizer_awq / quantizer_gptq / quantizer_compressed_tensors). The verifier's
# server is where the paper's AWQ 4-bit checkpoint runs; the phone's drafters never read these.
SERVER_QUANT = {"awq": ("gptqmodel",), "gptq": ("optimum", "gptqmodel"), "compressed-tensors": ("compressed_tensors",)}


def config_quant_method(config: dict[str, Any]) -> str | None:
    """A config.json's `quantization_config.quant_method` (top level or its text config), or None."""
    text = config.get("text_config") or {}
    return (config.get("quantization_config") or text.get("quantization_config") or {}).get("quant_method")


def quant_method(folder: str | Path, what: str = "model") -> str | None:
    """`config_quant_method` of the checkpoint in `folder` (None also without a config.json: the
    loader then says what is missing)."""
    if not (Path(folder) / "config.json").is_file():
        return None
    return config_quant_method(read_json(Path(folder) / "config.json", f"{what} config.json"))


def check_server_quant(folder: str | Path, method: str, what: str = "the verifier") -> None:
    """One line naming the package(s) a quantized checkpoint (`what`: how the line names it) needs,
    when they are not installed; an unknown method is refused with the ones this project reads."""
    import importlib.util

    if method not in SERVER_QUANT:
        raise HycoError(f"{Path(folder) / 'config.json'}: {what} must be a float checkpoint or quantized with one "
                        f"of {', '.join(SERVER_QUANT)}, but its quant_method is {method!r}")
    missing = [p.replace("_", "-") for p in SERVER_QUANT[method] if importlib.util.find_spec(p) is None]
    if missing:
        raise HycoError(f"{Path(folder) / 'config.json'}: {what} is quantized with {method!r}; transformers needs "
                        f"the {' and '.join(missing)} package to load it (pip install {' '.join(missing)})")


def load_verifier(folder: str | Path, placement, what: str = "verifier"):
    """The verifier as `placement` (recipe.PlacementConfig) puts it: its dtype (auto: BF16 on a
    GPU, fp32 on a CPU), and accelerate's `device_map` / `max_memory` / `offload_folder`. A
    quantized checkpoint (SERVER_QUANT) loads through transformers' quantizer when its package is
    installed, else one line names the package. A BF16
    load is transformers' own (its non-persistent buffers, such as the embedding scale, as
    transformers computes them); offloaded layers compute the same outputs."""
    import os

    import torch

    from hyco.base.launch import launched

    gpu = torch.cuda.is_available()
    dtype = {"auto": torch.bfloat16 if gpu else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[placement.dtype]
    kwargs = {"dtype": dtype}
    device_map = placement.device_map or ("auto" if gpu or placement.max_memory or placement.offload_folder else None)
    if launched() and gpu and placement.device_map is None:
        device_map = {"": int(os.environ.get("LOCAL_RANK", "0"))}  # one whole copy per process of a launch
    if device_map is not None:
        kwargs["device_map"] = device_map
    if placement.max_memory:
        kwargs["max_memory"] = {int(k) if str(k).isdigit() else k: v for k, v in placement.max_memory.items()}
    if placement.offload_folder:
        kwargs["offload_folder"] = str(placement.offload_folder)
    method = quant_method(folder, what)
    if method is not None:  # AWQ / GPTQ / compressed-tensors: their integer tensors are the format
        check_server_quant(folder, method, f"the {what}")
    return load_pretrained(folder, what, float_checkpoint=method is None, **kwargs).eval()
