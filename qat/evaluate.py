"""Agreement with the float head: top-1 equality and KL on response positions."""

from __future__ import annotations

import torch
from hyco.qat.mtp import dense_rows
from hyco.qat.quantsim import plain
from hyco.qat.train import kl_teacher_student, model_inputs

from hyco.npu.captures import Capture


@torch.no_grad()
def agreement(model: torch.nn.Module, teacher: torch.nn.Module, captures: list[Capture], sliding_window: int,
              device, negative: float) -> dict[str, float]:
    """Top-1 agreement with the teacher and mean KL(teacher || model), over all response
    positions of `captures` (each sequence weighted by its positions), on the rows that ship.

    A centroid-masked head adds `kl_dense` (the dense keep-set rows, what training lowers) and
    `same_scored_tokens` (positions where the model scores exactly the teacher's tokens: where it
    does not, the masked KL charges the fill's gap for the teacher's mass outside the model's set)."""
    masked = getattr(teacher, "masked_embedding", None) is not None
    agree = positions = same = 0
    kl_sum = kl_dense = 0.0
    for cap in captures:
        inputs = model_inputs(cap, sliding_window, device, negative)
        t_logits, _ = teacher(*inputs)
        s_logits, _ = model(*inputs)
        s_logits = plain(s_logits)
        n = t_logits.shape[1]
        agree += int((t_logits.argmax(-1) == s_logits.argmax(-1)).sum())
        kl_sum += float(kl_teacher_student(t_logits, s_logits)) * n
        positions += n
        if masked:
            with dense_rows(teacher, model):
                t_dense, s_dense = teacher(*inputs)[0], plain(model(*inputs)[0])
            kl_dense += float(kl_teacher_student(t_dense, s_dense)) * n
            same += int(((t_logits == t_dense) == (s_logits == s_dense)).all(-1).sum())  # the fill differs from the dense logit
    result = {"top1_agreement": agree / max(positions, 1), "kl": kl_sum / max(positions, 1), "positions": positions}
    if masked:
        result |= {"kl_dense": kl_dense / max(positions, 1), "same_scored_tokens": same / max(positions, 1)}
    return result
