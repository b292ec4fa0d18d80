"""Embedding tables as CPU lookup tables, at the checkpoint's bits, copied through the files.

The NPU graph takes embedding rows as inputs (a per-row DequantizeLinear feeding a Gather is
rejected by the HTP, and 1+ GB of per-layer table has no business on it anyway). Each table
is copied verbatim from the checkpoint, packed ints and per-row (or block) scales, into
`luts/<name>.safetensors` with its bit width, row width and transformers' `embed_scale` in the
metadata, byte for byte from the checkpoint's file in 64 MiB steps (never whole in memory);
`host.EmbeddingLut.open` memory-maps it and `lookup` reads back the rows it needs, bit-exactly.
"""

from __future__ import annotations

from pathlib import Path

from hyco.convert.load import Checkpoint

from hyco.base.errors import HycoError

TABLES = {  # LUT file name -> (module in the text model, embed_scale as transformers sets it)
    "embed_tokens": lambda tc: tc.hidden_size**0.5,
    "embed_tokens_per_layer": lambda tc: tc.hidden_size_per_layer_input**0.5,
}


def write_luts(ckpt: Checkpoint, text_config, out: Path) -> dict[str, dict]:
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
        dim = text_config.hidden_size if name == "embed_tokens" else (
            text_config.num_hidden_layers * text_config.hidden_size_per_layer_input)
        meta = {"bits": str(bits), "dim": str(dim), "embed_scale": repr(float(embed_scale(text_config))),
                "source": module}
        path = out / f"{name}.safetensors"
        fields = {"packed": key, "scale": f"{module}.embedding_scale"}
        shapes = copy_tensors(path, {field: ckpt.tensors[tensor][2] for field, tensor in fields.items()}, fields, meta)
        written[name] = {"file": f"luts/{path.name}", "bits": bits, "rows": shapes["packed"][0],
                         "dim": dim, "scale_blocks": shapes["scale"][-1],
                         "embed_scale": float(embed_scale(text_config)), "bytes": path.stat().st_size}
    return written


CHUNK = 64 << 20  # bytes per copy step


def copy_tensors(path: Path, files: dict[str, Path], names: dict[str, str], metadata: dict[str, str]) -> dict:
    """Write a safetensors file whose tensor `field` is tensor `names[field]` of `files[field]`,
    byte for byte: the header is built from the source headers and the data copied in 64 MiB
    steps, so a 1 GB per-layer table never comes into memory. Returns field -> shape."""
    import json

    from hyco.base.loading import safetensors_header

    header: dict = {"__metadata__": metadata}
    spans = []
    offset = 0
    for field, tensor in names.items():
        info = safetensors_header(files[field])[tensor]
        begin, end = info["data_offsets"]
        with open(files[field], "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
        header[field] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + end - begin]}
        spans.append((files[field], data_start + begin, end - begin))
        offset += end - begin
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(path, "wb") as dst:
        dst.write(len(raw).to_bytes(8, "little"))
        dst.write(raw)
        for src_path, start, length in spans:
            with open(src_path, "rb") as src:
                src.seek(start)
                while length:
                    chunk = src.read(min(CHUNK, length))
                    if not chunk:
                        raise HycoError(f"{src_path}: truncated while copying a table into {path}")
                    dst.write(chunk)
                    length -= len(chunk)
    return {field: [int(d) for d in header[field]["shape"]] for field in names}
