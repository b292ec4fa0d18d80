"""The rule by which an HTP pass agrees with the CPU EP's pass on the same feeds (smoke, check on
the bundle, calibrate's simulator check): top-k ids equal, except swaps of two tokens whose CPU
log-probs are within TIE_MARGIN (and the bound) of each other, and top-k log-probs within the
graph's bound.

TIE_MARGIN: two integer implementations of one graph that each keep every log-prob within d of the
other can swap two tokens only where their log-probs are within 2d. On the tiny main job's bundle
(4 prompts x 3 rounds, 75 passes) the HTP simulator and the CPU differed by at most 0.155 nats (tree
0.110, prefill 0.155, MTP 0.033) and the widest swap was 0.086 nats apart on the CPU: 2 x 0.155
rounded up. A swap across a wider gap is a wrong number, whatever the graph's bound."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyco.io_spec import Role, role_of

TOPK_OUTPUTS = (("topk_logprobs", "topk_indices"), ("topk_logprobs", "topk_ids"))
TIE_MARGIN = 0.35
# New K/V rows (what later passes read from the ring): within this many steps of their 8-bit grid.
# The main job's bundle: at most 2.3 steps (0.061 on a step of 0.027); the value projection of one
# prefill layer at twice its scale: 38 steps, while every log-prob of that pass stayed within 0.31
# nats (its harm comes in later passes, through the ring).
KV_STEPS = 4.0


class PassLog:
    """Per graph role: every pass's HTP-vs-CPU comparison on identical feeds. `tolerance`: one
    bound for every graph, or a bound per graph role."""

    def __init__(self, tolerance: float | dict[str, float], kv_steps: dict[str, dict[str, float]] | None = None):
        """`kv_steps`: per graph role, each new K/V output's grid step (its values compared in float);
        None: new K/V rows are reported, not held to KV_STEPS."""
        self.tolerance, self.kv_steps = tolerance, kv_steps
        self.rows: list[dict[str, Any]] = []

    def bound(self, role: str) -> float:
        return self.tolerance[role] if isinstance(self.tolerance, dict) else self.tolerance

    def record(self, role: str, names, htp, cpu, active: int | None = None) -> None:
        """`active`: only the first rows are compared (the SLM graphs' padding rows, which see only
        themselves and are never read, carry no draft; their near-ties would count as tie swaps)."""
        bound = self.bound(role)
        margin = min(bound, TIE_MARGIN)
        a, b = dict(zip(names, htp, strict=True)), dict(zip(names, cpu, strict=True))
        lp_name, id_name = next(p for p in TOPK_OUTPUTS if p[0] in a and p[1] in a)
        ids_h, ids_c = np.asarray(a[id_name])[:active], np.asarray(b[id_name])[:active]
        lp_h, lp_c = np.asarray(a[lp_name], np.float64)[:active], np.asarray(b[lp_name], np.float64)[:active]
        mismatches = ties = 0
        widest_tie = 0.0
        for r in range(ids_c.shape[0]):
            cpu_lp = dict(zip(ids_c[r].tolist(), lp_c[r].tolist(), strict=True))
            for j in np.flatnonzero(ids_h[r] != ids_c[r]):
                # the HTP's token at rank j: its CPU log-prob (at most the k-th if outside CPU's top-k)
                gap = abs(lp_c[r, j] - cpu_lp.get(int(ids_h[r, j]), lp_c[r, -1]))
                if gap <= margin:
                    ties += 1
                    widest_tie = max(widest_tie, gap)
                else:
                    mismatches += 1
        kv_names = [n for n in names if role_of(n) is Role.NEW_KV]
        kv = [float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in kv_names]
        steps = (self.kv_steps or {}).get(role)
        kv_steps = max(d / steps[n] for d, n in zip(kv, kv_names, strict=True)) if steps and kv else None
        self.rows.append({"role": role, "rows": int(ids_c.shape[0]), "id_mismatches": mismatches, "tie_swaps": ties, "widest_tie_nats": widest_tie, "tie_margin": margin,
                          "top1_equal": int((ids_h[:, 0] == ids_c[:, 0]).sum()), "bound": bound,
                          "ids_equal_rows": int((ids_h == ids_c).all(-1).sum()),
                          "max_logprob_diff": float(np.abs(lp_h - lp_c).max()),
                          "max_kv_diff": max(kv) if kv else None, "max_kv_steps": kv_steps})

    def ok(self, row: dict[str, Any]) -> bool:
        kv_ok = row.get("max_kv_steps") is None or row["max_kv_steps"] <= KV_STEPS
        return row["id_mismatches"] == 0 and row["max_logprob_diff"] <= row["bound"] and kv_ok
