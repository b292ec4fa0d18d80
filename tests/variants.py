"""SLMs unlike any fixture, for issue 37's sweep over checkpoint statistics: a trained one at
another shape, and variants of it with other weight scales, norm spreads, output-layer scales and
the softcap on or off. Each is written as the SLM of the tiny published family (its tokenizer,
verifier and MTP head stay), so a recipe takes it with `models.slm=`.

- `train_slm`: default init at `shape` (SlmShape fields over the tiny preset's), trained as a
  language model on the corpus's training partition for `steps` (AdamW, lr 3e-3, 16 x 128
  tokens a step), then quantized into the QAT-mobile layout by the fixture writer (2/4/8-bit
  map, SRQ and KV-cache scales calibrated on corpus text), as the shipped family's SLM is.
- `vary`: a written SLM rewritten as tests/peaky.py rewrites one, but around its own weights: norm
  weights spread, weight and output SRQ scales x gain, the final norm's weight x `logit_scale`
  (the output layer's logits scale with it: it feeds the tied table), the softcap set or removed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from peaky import NORM, TEXT
from safetensors.torch import load_file, save_file

FINAL_NORM = ("model.language_model.norm.weight", "model.norm.weight")


def train_slm(family: dict[str, Path], out: Path, *, shape: dict, steps: int, seed: int = 0) -> dict:
    """The trained SLM in `out` (family's tokenizer); returns its training figures."""
    from transformers import AutoTokenizer

    from hyco.fixtures import distill, models
    from hyco.fixtures.presets import get_preset
    from hyco.fixtures.tokenizer import read_training_text
    from hyco.fixtures.writer import DATASET, calibration_ids, copy_tokenizer, family_configs, write_slm

    base = get_preset("tiny")
    spec = dataclasses.replace(base, name="tiny-variant", slm=dataclasses.replace(base.slm, **shape))
    tok = AutoTokenizer.from_pretrained(str(family["tokenizer"]))
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    stream = torch.tensor([i for s in distill.corpus(tok, 0, 1500, 1024) for i in s])
    config = family_configs(spec)["slm"]
    model = distill.float_model(config, models.random_source(seed, "slm"))
    losses = distill.train(model, list(model.parameters()), steps, 3e-3,
                           lambda x: model(input_ids=x, labels=x, use_cache=False).loss,
                           distill.windows(stream, 128, 16, g), "variant slm")
    calib = calibration_ids(family["tokenizer"], read_training_text(DATASET, spec.tokenizer.train_bytes),
                            spec.calibration_tokens)
    write_slm(out, config, spec, distill.state_source(model), calib, models.random_source(seed, "slm"))
    copy_tokenizer(family["tokenizer"], out)
    return {"shape": shape, "steps": steps, "seed": seed, "loss_first": round(losses[0], 3),
            "loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 3), "train_tokens": len(stream)}


def vary(src: Path, dst: Path, *, seed: int = 0, weight_gain: float = 1.0, norm_spread: float = 0.0,
         logit_scale: float = 1.0, softcap: float | None | str = "keep", srq: str = "scale") -> Path:
    """`src` rewritten into `dst`: every text-model norm weight x (1 + norm_spread x randn), every
    decoder linear's weight scale x `weight_gain` (its codes keep their range), the final norm's
    weight x `logit_scale`, the softcap set (None: off) unless "keep". The SRQ scales: "scale":
    the output SRQ scales x `weight_gain` as well, the input ones kept (what a checkpoint edited
    without retraining would hold: down_proj's output, which shrinks as gain^3 through the gated
    MLP, then uses a few of its 255 codes); "refit": every SRQ scale measured again on the varied
    model (`refit_srq`), as quantization-aware training would have fitted it."""
    if srq not in ("scale", "refit"):
        raise ValueError(f"srq must be 'scale' or 'refit', but got {srq!r}")
    g = torch.Generator().manual_seed(seed)
    dst.mkdir(parents=True)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in sorted(tensors):
            t = tensors[name]
            if not TEXT.match(name):
                continue
            if NORM.search(name) and norm_spread:
                t = t.float() * (1.0 + norm_spread * torch.randn(t.shape, generator=g))
            if name in FINAL_NORM:
                t = t.float() * logit_scale
            if ".layers." in name and name.endswith((".weight_scale", ".output_activation_scale")):
                t = t * weight_gain
            tensors[name] = t.to(tensors[name].dtype).contiguous()
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if softcap != "keep":
        config.get("text_config", config)["final_logit_softcapping"] = softcap
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (shutil.copytree if f.is_dir() else shutil.copy)(f, dst / f.name)
    if srq == "refit":
        refit_srq(dst)
    return dst


SRQ = (".input_activation_scale", ".output_activation_scale")


def refit_srq(folder: Path) -> None:
    """Every nonzero SRQ scale of the SLM in `folder` set again as the fixture writer sets it
    (`hyco.fixtures.slm.calibrate`: SRQ_MARGIN x absmax / 127 of the linear's input or output, SRQ
    off, on the same corpus text), measured through transformers' own loader of the QAT format."""
    from hyco.base.loading import load_pretrained
    from hyco.fixtures.presets import get_preset
    from hyco.fixtures.slm import INT8_MAX, SRQ_MARGIN
    from hyco.fixtures.tokenizer import read_training_text
    from hyco.fixtures.writer import DATASET, calibration_ids

    shards = {shard: load_file(str(shard)) for shard in sorted(folder.glob("*.safetensors"))}
    fitted = {name for tensors in shards.values() for name, t in tensors.items()
              if name.endswith(SRQ) and float(t) != 0.0}
    for shard, tensors in shards.items():  # SRQ off while measuring
        save_file({k: torch.zeros_like(t) if k in fitted else t for k, t in tensors.items()}, str(shard),
                  metadata={"format": "pt"})
    model = load_pretrained(folder, "varied SLM", float_checkpoint=False, dtype=torch.float32).eval()
    modules = {name.split(".layers.", 1)[1]: m for name, m in model.named_modules() if ".layers." in name}
    absmax, hooks = {}, []  # by the name after ".layers.": the loader may drop the checkpoint's prefix
    for key in {k.split(".layers.", 1)[1].rsplit(".", 1)[0] for k in fitted}:
        def hook(mod, args, out, key=key):
            absmax[f"{key}.input_activation_scale"] = float(args[0].abs().max())
            absmax[f"{key}.output_activation_scale"] = float(out.abs().max())
        hooks.append(modules[key].register_forward_hook(hook))
    spec = get_preset("tiny")
    ids = calibration_ids(folder, read_training_text(DATASET, spec.tokenizer.train_bytes), spec.calibration_tokens)
    with torch.no_grad():
        model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    for shard, tensors in shards.items():
        for name in fitted & set(tensors):
            tensors[name] = torch.tensor(SRQ_MARGIN * absmax[name.split(".layers.", 1)[1]] / INT8_MAX,
                                         dtype=tensors[name].dtype)
        save_file(tensors, str(shard), metadata={"format": "pt"})


def copy_family(family: dict[str, Path], slm: Path) -> dict[str, Path]:
    """The family's folders with `slm` in the SLM's place."""
    return {**family, "slm": slm}


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
