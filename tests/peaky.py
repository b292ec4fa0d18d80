"""A peakier SLM than any fixture the project tunes on, written from a family's SLM folder in
whatever layout it has (published one-file wrapper or text-only shards): every text-model norm
weight 1 + spread * randn, every text-model linear's weight scale (and its output SRQ scale, so
its codes keep their range) x `weight_gain`, and the sliding window shrunk to `sliding_window`
(so the rings wrap inside the short calibration answers). Towers, tables and lm_head are
copied as they are (lm_head must keep the token table's bytes under the tie flag)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

TEXT = re.compile(r"^(model\.language_model\.|model\.)(?!vision_tower|audio_tower|embed_vision|embed_audio)")
NORM = re.compile(r"norm\.weight$")


def write_peaky(src: Path, dst: Path, *, seed: int = 0, weight_gain: float = 3.0, norm_spread: float = 0.3,
                sliding_window: int = 8) -> Path:
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    dst.mkdir(parents=True)
    files = sorted(p for p in src.glob("*.safetensors"))
    for shard in files:
        tensors = load_file(str(shard))
        for name in sorted(tensors):
            t = tensors[name]
            if not TEXT.match(name) or ".layers." not in name and not name.endswith("norm.weight"):
                continue
            if NORM.search(name):
                tensors[name] = (1.0 + norm_spread * torch.randn(t.shape, generator=g)).to(t.dtype)
            elif name.endswith((".weight_scale", ".output_activation_scale")) and ".layers." in name:
                tensors[name] = (t * weight_gain).contiguous()
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    text["sliding_window"] = sliding_window
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (shutil.copytree if f.is_dir() else shutil.copy)(f, dst / f.name)
    return dst
