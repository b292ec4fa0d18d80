"""Embedding tables as CPU lookup tables, at the checkpoint's bits.

The NPU graph takes embedding rows as inputs (a per-row DequantizeLinear feeding a Gather is
rejected by the HTP, and 1+ GB of per-layer table has no business on it anyway). Each table
is copied verbatim from the checkpoint, packed ints and per-row (or block) scales, into
`luts/<name>.safetensors` with its bit width, row width and transformers' `embed_scale` in the
metadata; `host.EmbeddingLut.lookup` reads it back bit-exactly.
"""

from __future__ import annotations

from pathlib import Path

from hyco.convert.load import Checkpoint

from hyco.errors import HycoError

TABLES = {  # LUT file name -> (module in the text model, embed_scale as transformers sets it)
    "embed_tokens": lambda tc: tc.hidden_size**0.5,
    "embed_tokens_per_layer": lambda tc: tc.hidden_size_per_layer_input**0.5,
}


def write_luts(ckpt: Checkpoint, text_config, out: Path) -> dict[str, dict]:
    from safetensors.numpy import save_file

    from hyco.loading import open_safetensors, read_tensor

    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, embed_scale in TABLES.items():
        if name == "embed_tokens_per_layer" and not text_config.hidden_size_per_layer_input:
            continue
        module = ckpt.layout.text_prefix + name
        key = f"{module}.embedding_quantized"
        if key not in ckpt.tensors:
            raise HycoError(f"{ckpt.folder}: {module} is not quantized ({key} missing); the LUTs keep the "
                            "checkpoint's integer tables (quantize_embeddings: true)")
        bits = ckpt.bits[module]
        tensors = {}
        for field, tensor_name in (("packed", key), ("scale", f"{module}.embedding_scale")):
            path = ckpt.tensors[tensor_name][2]
            with open_safetensors(path, framework="numpy") as f:
                tensors[field] = read_tensor(f, tensor_name, path)
        dim = text_config.hidden_size if name == "embed_tokens" else (
            text_config.num_hidden_layers * text_config.hidden_size_per_layer_input)
        meta = {"bits": str(bits), "dim": str(dim), "embed_scale": repr(float(embed_scale(text_config))),
                "source": module}
        path = out / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        written[name] = {"file": f"luts/{path.name}", "bits": bits, "rows": int(tensors["packed"].shape[0]),
                         "dim": dim, "scale_blocks": int(tensors["scale"].shape[-1]),
                         "embed_scale": float(embed_scale(text_config)), "bytes": path.stat().st_size}
    return written
