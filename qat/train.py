"""KL QAT of the MTP head (paper, Table 4).

Loss: KL(teacher || student) over the keep set, on response positions only; the teacher is
the float head, frozen. Gradients pass AIMET's fake quantization by the straight-through
estimator; weights and weight encodings train, activation encodings stay as calibrated. AdamW (0.9, 0.95), no weight decay,
gradient-norm clip 1.0, linear warm-up then cosine, one sequence per micro-batch, gradient
accumulation; fp32 master weights, BF16 autocast only where the recipe switches it on (GPUs).

A centroid-masked head trains on its dense keep-set row: the centroid choice is a hard TopK with no
gradient, the masked row is the dense one restricted to the chosen clusters, and where student and
teacher choose differently a masked KL would charge the student the gap for tokens it cannot learn
to score. The agreement figures (evaluate.py) and the graphs use the masked row that ships.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from hyco.qat.lean_qdq import lean_weight_qdq
from hyco.qat.mtp import dense_rows, teacher_forced_inputs
from hyco.qat.quantsim import plain

from hyco.base.console import progress
from hyco.config.recipe import QatConfig
from hyco.npu.captures import Capture


def lr_at(step: int, cfg: QatConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from `lr` to 0 at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    return 0.5 * cfg.lr * (1 + math.cos(math.pi * (step - cfg.warmup_steps) / span))


def model_inputs(capture: Capture, sliding_window: int, device, negative: float) -> tuple[torch.Tensor, ...]:
    # `negative` is the step graph's own mask value (qat.mask_negative): the head trains on the
    # masks the phone will feed it, not on a -1e9 the 16-bit graph could not represent.
    inputs = teacher_forced_inputs(capture.embeds, capture.hidden, capture.kv, sliding_window,
                                   positions=capture.drafting_positions, negative=negative)
    return tuple(x.to(device) for x in inputs)


def kl_teacher_student(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_teacher || p_student), both over the same (kept) vocabulary."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def train_student(sim, teacher: torch.nn.Module, captures: Sequence[Capture], cfg: QatConfig,
                  sliding_window: int, device) -> list[dict]:
    """Run `cfg.steps` optimizer steps on `sim.model`, one sequence per micro-batch (loaded on
    access, so memory holds one sequence); returns the per-step history."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    # Weights and their encodings train; the 16-bit activation encodings stay as calibrated, so
    # the ranges written to encodings.json are the ones the student was trained with and no
    # range shrinks into clipping the step graph does not reproduce.
    params = [p for name, p in sim.model.named_parameters()
              if p.requires_grad and "input_quantizers" not in name and "output_quantizers" not in name]
    # fused: one kernel per parameter, no temporaries (the per-tensor loop built two
    # output-layer-sized ones for its denominator, on top of the full-size step's peak)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
    order: list[int] = []
    history = []
    sim.model.train()
    use_autocast = cfg.bf16_autocast and device.type in ("cuda", "cpu")
    # lean: the output layer's fake-quant backward a block of rows at a time (peak)
    with lean_weight_qdq(), dense_rows(teacher, sim.model):
        for step in progress(range(cfg.steps), desc="qat: train", unit="step", disable=None):
            start = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(cfg.grad_accumulation):
                if not order:
                    order = list(range(len(captures)))
                    rng.shuffle(order)
                inputs = model_inputs(captures[order.pop()], sliding_window, device, cfg.mask_negative)
                with torch.no_grad():
                    teacher_logits, _ = teacher(*inputs)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                    student_logits, _ = sim.model(*inputs)
                loss = kl_teacher_student(teacher_logits, plain(student_logits)) / cfg.grad_accumulation
                loss.backward()
                total += float(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            history.append({"step": step, "loss": total, "lr": lr_at(step, cfg), "grad_norm": float(grad_norm),
                            "wall_s": round(time.perf_counter() - start, 4)})
    opt.zero_grad(set_to_none=True)  # the last step's gradients (one more copy of the student) go with the optimizer
    sim.model.eval()
    return history
