"""Agreement with the float head: top-1 equality and KL on response positions."""

from __future__ import annotations

import torch
from hyco.qat.quantsim import plain
from hyco.qat.train import kl_teacher_student, model_inputs

from hyco.captures import Capture


@torch.no_grad()
def agreement(model: torch.nn.Module, teacher: torch.nn.Module, captures: list[Capture], sliding_window: int,
              device, negative: float) -> dict[str, float]:
    """Top-1 agreement with the teacher and mean KL(teacher || model), over all response
    positions of `captures` (each sequence weighted by its positions)."""
    agree = positions = 0
    kl_sum = 0.0
    for cap in captures:
        inputs = model_inputs(cap, sliding_window, device, negative)
        t_logits, _ = teacher(*inputs)
        s_logits, _ = model(*inputs)
        s_logits = plain(s_logits)
        n = t_logits.shape[1]
        agree += int((t_logits.argmax(-1) == s_logits.argmax(-1)).sum())
        kl_sum += float(kl_teacher_student(t_logits, s_logits)) * n
        positions += n
    return {"top1_agreement": agree / max(positions, 1), "kl": kl_sum / max(positions, 1), "positions": positions}
