"""The QAT student: the HF gemma4_assistant head inside aimet-torch's QuantizationSimModel.

Every Linear (the restricted, untied output layer included) gets a symmetric per-channel
weight quantizer (4-bit: -8..7) and 16-bit output quantizers; norm weights stay float and
frozen (AIMET would quantize them to 4 bits unless its config says otherwise; platform notes).
The initial weight encodings come from a per-channel clipping-ratio search (1.0 down to 0.6,
minimising the weight quantization MSE), written with each quantizer's `set_range`: AIMET has
no such search built in (its `apply_seq_mse` searches other ratios and freezes encodings).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from hyco.qat.mtp import TeacherForcedHead
from torch import nn

_AIMET_DEFAULT = "default_config_per_channel.json"


def aimet_config(path: Path) -> Path:
    """AIMET's per-channel default config, plus: norm weights not quantized (why: see module doc)."""
    from aimet_torch.common.quantsim_config import quantsim_config

    base = Path(quantsim_config.__file__).with_name(_AIMET_DEFAULT)
    cfg = json.loads(base.read_text())
    cfg["op_type"]["RMSNormalization"] = {"params": {"weight": {"is_quantized": "False"}}}
    path.write_text(json.dumps(cfg, indent=1))
    return path


def make_student(head: nn.Module, keep_ids: torch.Tensor | None, example_inputs: tuple, *,
                 weight_bits: int, activation_bits: int, config_path: Path, rows: nn.Linear | None = None):
    """A QuantizationSimModel over a copy of `head` (the teacher stays untouched). `rows`: the
    output layer already cut to the keep set (the teacher's), copied instead of `head`'s."""
    from aimet_torch.quantsim import QuantizationSimModel

    # One copy of the head's weights, not three: the text model's own embedding table is never
    # used (the inputs are embeddings; no encoding for a table that does not exist on the phone)
    # and the full-vocabulary output layer is only read for its keep-set rows, so neither is
    # copied (262,144 x 1,024 fp32 each at the 26B-A4B assistant's size), and
    # QuantSim wraps this private copy in place instead of deep-copying it again.
    embed, lm_head = head.model.embed_tokens, head.lm_head
    memo = {id(lm_head): lm_head}  # shared (read only): restricted_lm_head copies the kept rows
    if embed is not None:
        memo[id(embed)] = None
    student = TeacherForcedHead(copy.deepcopy(head, memo), keep_ids, rows)
    student.model.embed_tokens = None
    for module in student.modules():
        if "RMSNorm" in type(module).__name__:
            for p in module.parameters():
                p.requires_grad_(False)  # norms are frozen (paper, Table 4)
    return QuantizationSimModel(student, example_inputs, default_param_bw=weight_bits,
                                default_output_bw=activation_bits, config_file=str(config_path), in_place=True)


def quantized_linears(sim) -> dict[str, nn.Module]:
    """Module name -> quantized Linear, in module order."""
    return {name: m for name, m in sim.model.named_modules()
            if isinstance(m, nn.Linear) and getattr(m, "param_quantizers", None) and m.param_quantizers["weight"] is not None}


def weight_qrange(quantizer) -> tuple[int, int]:
    return int(quantizer.qmin), int(quantizer.qmax)


@torch.no_grad()
def best_clip_scales(weight: torch.Tensor, qmin: int, qmax: int, ratio_max: float, ratio_min: float,
                     steps: int = 41) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, the scale r * max|w| / qmax (r from ratio_max down to ratio_min)
    with the least squared error of the fake-quantized row. Returns (scale [out, 1], r [out])."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    best_err = torch.full((w.shape[0],), float("inf"))
    best_scale = amax / qmax
    best_ratio = torch.ones(w.shape[0])
    work = torch.empty_like(w)  # the same ops in place: one buffer, not six per ratio (the output
    for r in torch.linspace(ratio_max, ratio_min, steps).tolist():  # layer's is the largest at full size)
        scale = amax * r / qmax
        err = torch.div(w, scale, out=work).round_().clamp_(qmin, qmax).mul_(scale).sub_(w).square_().sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better[:, None], scale, best_scale)
        best_ratio = torch.where(better, torch.tensor(r), best_ratio)
    return best_scale, best_ratio


@torch.no_grad()
def apply_clip_search(sim, ratio_max: float, ratio_min: float) -> dict[str, float]:
    """Set every weight quantizer to its clip-searched per-channel scale; returns the mean
    chosen ratio per layer (for the report)."""
    chosen = {}
    for name, layer in quantized_linears(sim).items():
        q = layer.param_quantizers["weight"]
        qmin, qmax = weight_qrange(q)
        scale, ratio = best_clip_scales(layer.weight, qmin, qmax, ratio_max, ratio_min)
        # set_range(min, max) gives scale (max - min) / (qmax - qmin): exactly `scale` here.
        q.set_range(scale * qmin, scale * qmax)
        chosen[name] = round(float(ratio.mean()), 4)
    return chosen


@torch.no_grad()
def integer_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [qmin, qmax] [out, in], float32 scale [out]) of a quantized Linear,
    such that values * scale is exactly the weight the sim computes with."""
    q = layer.param_quantizers["weight"]
    qmin, qmax = weight_qrange(q)
    scale = q.get_scale().detach().float().reshape(-1, 1)
    if q.get_offset() is not None and bool((q.get_offset() != 0).any()):
        raise ValueError("weight encodings must be symmetric (offset 0)")
    values = torch.clamp(torch.round(layer.weight.detach().float() / scale), qmin, qmax)
    return values.to(torch.int8), scale.reshape(-1)


def attach_input_quantizers(sim, ranges: dict[str, tuple[float, float]], bits: int = 16) -> None:
    """Fixed-range asymmetric fake quantizers on the student's inputs (frozen), the same
    ranges the step graph's input QDQ uses, so training, evaluation and the graph agree."""
    from aimet_torch.quantization.affine import QuantizeDequantize

    qdq = nn.ModuleDict()
    for name, (lo, hi) in ranges.items():
        q = QuantizeDequantize(shape=(), bitwidth=bits, symmetric=False)
        q.set_range(torch.tensor(min(lo, 0.0)), torch.tensor(max(hi, 0.0)))
        q.requires_grad_(False)
        qdq[name] = q
    sim.model.input_qdq = qdq.to(next(sim.model.parameters()).device)


@torch.no_grad()
def recalibrate_activations(sim, forward) -> None:
    """The paper's final calibration: fresh 16-bit activation ranges for the trained weights,
    keeping the trained weight encodings and the fixed input ranges. (AIMET's compute_encodings
    recalibrates every quantizer, so the others are set aside and put back.)"""
    weights = {name: (layer.param_quantizers["weight"].min.detach().clone(),
                      layer.param_quantizers["weight"].max.detach().clone())
               for name, layer in quantized_linears(sim).items()}
    inputs, sim.model.input_qdq = sim.model.input_qdq, None
    try:
        sim.compute_encodings(lambda m, _: forward(m), None)
    finally:
        sim.model.input_qdq = inputs
    for name, layer in quantized_linears(sim).items():
        layer.param_quantizers["weight"].set_range(*weights[name])


def plain(x) -> torch.Tensor:
    """AIMET outputs are DequantizedTensor: a plain float tensor for losses and comparisons."""
    return x.as_subclass(torch.Tensor).float()
