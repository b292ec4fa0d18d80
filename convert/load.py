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

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.config.families import Layout, architecture, family_of

SUPPORTED_BITS = (2, 4, 8)
FLOAT_DTYPES = {"F32", "BF16", "F16"}


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
    # Linears the checkpoint leaves in float (quantization_config.modules_to_not_convert, matched
    # as transformers matches it): the NPU graph still needs their weights as integers.
    float_linears: set[str] = field(default_factory=set)
    # tie_word_embeddings with no lm_head.weight in the files: the output layer's ints and scales
    # are embed_tokens' (embedding_quantized, embedding_scale), as Gemma releases tie them.
    tied_head: bool = False

    @property
    def quant(self) -> dict[str, Any]:
        return self.config.get("quantization_config") or {}


# --- safetensors headers -------------------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors header, checked whole (hyco/base/loading.py): entries, byte spans, file size."""
    from hyco.base.loading import safetensors_header

    return safetensors_header(path)


# --- config ---------------------------------------------------------------------------------------


def read_checkpoint(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HycoError(f"config.json not found in {folder}")
    from hyco.base.loading import read_json

    config = read_json(config_path, "config.json")
    family = family_of(config, str(config_path))
    arch = architecture(config)
    if arch not in family.layouts:
        raise HycoError(f"{config_path}: architecture {arch!r} is not one of family {family.name}'s "
                        f"(registered: {', '.join(family.layouts)})")
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") not in family.slm_formats:
        raise HycoError(f"{config_path}: quantization_config.quant_method must be "
                        f"{' or '.join(map(repr, family.slm_formats))}, but got {quant.get('quant_method')!r} (family "
                        f"{family.name}'s SLM Drafter formats; 'gemma' is the QAT mobile format)")
    check_bits(quant.get("num_bits", 4), f"{config_path}: quantization_config.num_bits")
    for pattern, override in (quant.get("module_quant_configs") or {}).items():
        check_bits(override.get("num_bits", quant.get("num_bits", 4)),
                   f"{config_path}: quantization_config.module_quant_configs[{pattern!r}].num_bits")
        try:
            re.compile(pattern)
        except re.error as e:
            raise HycoError(f"{config_path}: quantization_config.module_quant_configs key {pattern!r} is not a "
                            f"regular expression ({e})") from None
    from hyco.base.loading import check_scales, checkpoint_files

    tensors = checkpoint_files(folder, "QAT")  # headers whole, shards not cut, index consistent
    check_scales(tensors)  # finite, weight/embedding scales > 0
    # transformers' default for tie_word_embeddings is true; a file that still holds lm_head.weight
    # keeps its own output layer (transformers, too, unties weights it finds in the checkpoint).
    tied = bool(config.get("tie_word_embeddings", True)) and "lm_head.weight" not in tensors
    return Checkpoint(folder, config, family.layouts[arch], tensors, tied_head=tied)


def check_bits(bits: Any, where: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise HycoError(f"{where} must be one of {list(SUPPORTED_BITS)}, but got {bits!r}")


def module_bits(name: str, quant: dict[str, Any]) -> int:
    """transformers' rule (replace_with_quant_layers), shared with every stage: see
    `hyco.formats.gemma_quant.bits_for_module` (leftmost match in the name wins)."""
    from hyco.formats.gemma_quant import bits_for_module

    return bits_for_module(name, quant.get("module_quant_configs"), quant.get("num_bits", 4))


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
    skip = not_converted_patterns(model, ckpt.quant)

    def checkpoint_name(name: str) -> str:  # Gemma4ForCausalLM name -> this layout's name
        return ckpt.layout.text_prefix + name[len("model."):] if name.startswith("model.") else name

    expect: dict[str, Expect] = {}
    quantized_modules = set()
    for name, module in model.named_modules():
        cname = checkpoint_name(name)
        is_linear, is_embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
        if not (is_linear or (is_embedding and quantize_embeddings)):
            continue
        if not converted(cname, skip):  # left in float: its tensors are the float ones (below)
            if is_linear:
                ckpt.float_linears.add(cname)
            continue
        bits = module_bits(cname, ckpt.quant)
        ckpt.bits[cname] = bits
        quantized_modules.add(name)
        rows, width = (module.out_features, module.in_features) if is_linear else (module.num_embeddings, module.embedding_dim)
        per_byte = 8 // bits
        packed = (rows, math.ceil(width / per_byte))
        int_dtype = frozenset({"I8"} if bits == 8 else {"U8"})
        if is_linear:
            if not (ckpt.tied_head and cname == "lm_head"):  # tied: embed_tokens' tensors (check_tied_head)
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


def not_converted_patterns(model, quant: dict[str, Any]) -> list[str]:
    """The patterns transformers' GemmaQuantizer leaves in float: the config's
    modules_to_not_convert (transformers' default skips when it is absent) and the model's
    fp32-kept modules, exactly as the quantizer gathers them."""
    from transformers.quantizers.base import HfQuantizer

    return HfQuantizer.get_modules_to_not_convert(model, quant.get("modules_to_not_convert"),
                                                  getattr(model, "_keep_in_fp32_modules", None))


def converted(name: str, patterns: list[str]) -> bool:
    """Does transformers quantize module `name` (the checkpoint's own module path)? Its own
    matcher: a pattern matches from the start to a module boundary, as a regex with the same
    boundary, or as a suffix."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return should_convert_module(name, patterns)


def first_kv_shared_layer(ckpt: Checkpoint) -> int:
    """The first KV-shared layer of the checkpoint's text model."""
    tc = text_config(ckpt.folder)
    return tc.num_hidden_layers - (tc.num_kv_shared_layers or 0)


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
    shared_from = first_kv_shared_layer(ckpt)
    unused_kv = re.compile(re.escape(ckpt.layout.text_prefix) + r"layers\.(\d+)\.self_attn\.(k_proj|v_proj)\.")
    report["unused_shared_kv"] = []
    for name in sorted(set(ckpt.tensors) - set(expect)):
        if name.endswith(("k_cache_scale", "v_cache_scale")):
            report["kv_cache_scales"].append(name)
        elif (m := unused_kv.match(name)) and int(m.group(1)) >= shared_from:
            # Published files keep k_proj / v_proj on KV-shared layers, which read another
            # layer's K/V: never used (transformers builds no such modules either).
            report["unused_shared_kv"].append(name)
        elif name.startswith(ckpt.layout.ignored_prefixes):
            report["ignored_towers"] += 1
        else:
            report["extra"].append(name)
    if ckpt.layout.ignored_prefixes:
        from hyco.base.loading import tower_tensors

        report["towers_left_on_disk"] = tower_tensors(ckpt.tensors)
    if report["missing"]:
        raise HycoError(f"{ckpt.folder}: missing tensor {report['missing'][0]} "
                        f"({len(report['missing'])} missing: {', '.join(report['missing'][:5])})")
    if report["misshapen"]:
        raise HycoError(f"{ckpt.folder}: misshapen tensor {report['misshapen'][0]}")
    if ckpt.tied_head:
        report["tied_head"] = check_tied_head(ckpt)
    return report


def tied_embedding(ckpt: Checkpoint) -> str:
    """The module whose table a tied output layer reuses (checkpoint name)."""
    return ckpt.layout.text_prefix + "embed_tokens"


def check_tied_head(ckpt: Checkpoint) -> dict[str, Any]:
    """A tied output layer is embed_tokens' quantized table read as a linear: it needs that table
    quantized, with one scale per row (what a QuantizedLinear's weight_scale [V, 1] is)."""
    embed = tied_embedding(ckpt)
    config_path = ckpt.folder / "config.json"
    if f"{embed}.embedding_quantized" not in ckpt.tensors:
        raise HycoError(f"{config_path}: tie_word_embeddings is true and there is no lm_head.weight, but {embed} is "
                        "not quantized (quantization_config.quantize_embeddings); the NPU graph's output layer needs "
                        "the integer table")
    dtype, shape, path = ckpt.tensors[f"{embed}.embedding_scale"]
    if shape[-1] != 1:
        raise HycoError(f"{path}: tensor {embed}.embedding_scale has {shape[-1]} blocks per row, but a tied output "
                        "layer needs one scale per row (tie_word_embeddings in config.json)")
    ckpt.bits["lm_head"] = ckpt.bits[embed]  # the tied layer unpacks the table at the table's width
    return {"ints": f"{embed}.embedding_quantized", "scales": f"{embed}.embedding_scale", "bits": ckpt.bits[embed]}


# --- loading through transformers ------------------------------------------------------------------


def load_model(ckpt: Checkpoint):
    """(text model, lm_head) through `from_pretrained` on the local folder (GemmaQuantizer path),
    in float32 activations so the graphs and the parity reference share one dtype."""
    import torch
    import transformers

    from hyco.base.loading import (
        block_scaled_tables,
        load_config,
        quiet_transformers,
        set_block_scales,
        share_tied_table,
        srq_scales_off,
        text_only_config,
        tied_quantized_class,
        untie,
    )

    cls = getattr(transformers, architecture(ckpt.config))
    # Text-only: a multimodal file's towers are never built, so their tensors stay on disk.
    config = text_only_config(ckpt.folder, "QAT") or load_config(ckpt.folder, "QAT")
    kwargs = {"config": config}
    if ckpt.tied_head:
        cls = tied_quantized_class(cls)
    elif "lm_head.weight" in ckpt.tensors:
        untie(config)  # the file's own output layer (a tied quantized pair would crash)
    blocks = block_scaled_tables(ckpt.tensors)
    if blocks:
        # transformers allocates one scale per row ([V, 1]) and refuses [V, blocks]: load the rest,
        # then give those tables their block scales (QuantizedEmbedding dequantizes per block).
        kwargs["ignore_mismatched_sizes"] = True
    try:
        with quiet_transformers():  # every tensor was checked above; its load table would repeat it
            model, info = cls.from_pretrained(str(ckpt.folder), dtype=torch.float32, output_loading_info=True, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
        raise HycoError(f"{ckpt.folder}: transformers could not load the checkpoint ({str(e).splitlines()[0]})") from None
    model.eval()
    mismatched = {k for k, *_ in info.get("mismatched_keys") or []}
    if mismatched - set(blocks):  # completeness() checked every shape: nothing else may differ
        raise HycoError(f"{ckpt.folder}: tensor {sorted(mismatched - set(blocks))[0]!r} has another shape than "
                        "transformers' model")
    set_block_scales(model, ckpt.tensors, blocks)
    text = model.model.language_model if ckpt.layout.name == "multimodal" else model.model
    if ckpt.tied_head:
        share_tied_table(model, ckpt.folder)
    srq_scales_off(model, info["missing_keys"])
    return model, text, model.lm_head


def kv_cache_scales(ckpt: Checkpoint, names: list[str]) -> dict[str, float]:
    """k/v_cache_scale tensors (transformers reads and drops them); calibrate/ reads them here."""
    from hyco.base.loading import open_safetensors, read_tensor

    out = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(ckpt.tensors[n][2], []).append(n)
    for path, ns in by_file.items():
        with open_safetensors(path) as f:
            for n in ns:
                out[n] = float(read_tensor(f, n, path).float().reshape(-1)[0])
    return out
