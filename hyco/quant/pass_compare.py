"""The rule by which an HTP pass agrees with the CPU EP's pass on the same feeds (smoke, check on
the bundle, calibrate's simulator check): top-k log-probs within the graph's bound, and top-k ids
equal except swaps of two tokens whose CPU log-probs are within the pass's tie margin.

The tie margin: two implementations of one graph that keep every log-prob within d of each other
can swap two tokens only where their log-probs are within 2d (a <= b + 2d when a - d <= b + d). So
a swap counts as a tie only within twice the pass's own measured difference d (the larger of the
per-rank and the per-token one over the tokens both top-k lists hold), capped by the bound: on the
tiny main job's bundle d was at most 0.155 nats and the widest swap 0.086 apart, while a swap
across more than 2d is a wrong number. Before, any swap within the whole bound (1.6-2.1 nats there)
counted as a tie."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyco.npu.io_spec import Role, role_of

TOPK_OUTPUTS = (("topk_logprobs", "topk_indices"), ("topk_logprobs", "topk_ids"))


def steps_apart(x, y, step: float) -> float:
    """The largest |x - y| in steps of a grid: codes are steps already, float values are divided by `step`."""
    x = np.asarray(x)
    d = float(np.abs(x.astype(np.float64) - np.asarray(y, np.float64)).max())
    return d if x.dtype.kind in "iu" else d / step


def measured_difference(ids_h, lp_h, ids_c, lp_c) -> float:
    """The largest |HTP - CPU| log-prob of a pass: rank by rank, and token by token over the tokens
    both rows' top-k hold."""
    d = float(np.abs(lp_h - lp_c).max()) if lp_c.size else 0.0
    for r in range(ids_c.shape[0]):
        cpu = dict(zip(ids_c[r].tolist(), lp_c[r].tolist(), strict=True))
        for token, value in zip(ids_h[r].tolist(), lp_h[r].tolist(), strict=True):
            if token in cpu:
                d = max(d, abs(value - cpu[token]))
    return d


class PassLog:
    """Per graph role: every pass's HTP-vs-CPU comparison on identical feeds. `tolerance`: one
    bound for every graph, or a bound per graph role."""

    def __init__(self, tolerance: float | dict[str, float], kv_steps: dict[str, dict[str, float]] | None = None,
                 kv_bound: float | dict[str, float | None] | None = None):
        """`kv_steps`: per graph role, each new K/V output's grid step (`kv_grid_steps`; values come
        back as codes or in float), for `max_kv_steps`: how far the rows a pass writes into the ring
        are apart, in steps of their 8-bit grid, held to `kv_bound` (one for every graph or one per
        role; None: reported, not held)."""
        self.tolerance, self.kv_steps, self.kv_bound = tolerance, kv_steps, kv_bound
        self.rows: list[dict[str, Any]] = []

    def bound(self, role: str) -> float:
        return self.tolerance[role] if isinstance(self.tolerance, dict) else self.tolerance

    def kv_step_bound(self, role: str) -> float | None:
        return self.kv_bound.get(role) if isinstance(self.kv_bound, dict) else self.kv_bound

    def record(self, role: str, names, htp, cpu, active: int | None = None, noisy: list | None = None) -> None:
        """`active`: only the first rows are compared (the SLM graphs' padding rows, which see only
        themselves and are never read, carry no draft; their near-ties would count as tie swaps).
        `noisy`: the same pass's outputs from the CPU graph perturbed by the HTP's measured per-op
        codes (one list per draw): how far a correct HTP could move this very pass. The pass is
        then held to the larger of the graph's bound and `NOISE_FACTOR` x that (`pass_bound`,
        `kv_pass_bound`): a prompt more sensitive than calibrate's passes gets room, and only it."""
        a, b = dict(zip(names, htp, strict=True)), dict(zip(names, cpu, strict=True))
        lp_name, id_name = next(p for p in TOPK_OUTPUTS if p[0] in a and p[1] in a)
        ids_h, ids_c = np.asarray(a[id_name])[:active], np.asarray(b[id_name])[:active]
        lp_h, lp_c = np.asarray(a[lp_name], np.float64)[:active], np.asarray(b[lp_name], np.float64)[:active]
        kv_names = [n for n in names if role_of(n) is Role.NEW_KV]
        steps = (self.kv_steps or {}).get(role)

        def kv_apart(x: dict) -> float | None:  # the new K/V rows' distance from the CPU's, in grid steps
            return max(steps_apart(x[n], b[n], steps[n]) for n in kv_names) if steps and kv_names else None
        noise = noise_kv = None
        for out in noisy or []:
            n = dict(zip(names, out, strict=True))
            d = measured_difference(np.asarray(n[id_name])[:active], np.asarray(n[lp_name], np.float64)[:active], ids_c, lp_c)
            noise, k = max(noise or 0.0, d), kv_apart(n)
            noise_kv = None if k is None else max(noise_kv or 0.0, k)
        bound = self.bound(role) if noise is None else max(self.bound(role), NOISE_FACTOR * noise)
        kv_bound = self.kv_step_bound(role)
        if kv_bound is not None and noise_kv is not None:
            kv_bound = max(kv_bound, NOISE_FACTOR * noise_kv)
        measured = measured_difference(ids_h, lp_h, ids_c, lp_c)
        margin = min(bound, 2 * measured)
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
        kv = [float(np.abs(np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64)).max()) for n in kv_names]
        self.rows.append({"role": role, "rows": int(ids_c.shape[0]), "id_mismatches": mismatches, "tie_swaps": ties,
                          "widest_tie_nats": widest_tie, "tie_margin": margin,
                          "top1_equal": int((ids_h[:, 0] == ids_c[:, 0]).sum()), "bound": self.bound(role),
                          "ids_equal_rows": int((ids_h == ids_c).all(-1).sum()), "max_logprob_diff": measured,
                          "noise_logprob": noise, "pass_bound": bound,
                          "max_kv_diff": max(kv) if kv else None, "max_kv_steps": kv_apart(a),
                          "kv_step_bound": self.kv_step_bound(role), "noise_kv_steps": noise_kv, "kv_pass_bound": kv_bound})

    @staticmethod
    def ok(row: dict[str, Any]) -> bool:
        kv_ok = row["kv_pass_bound"] is None or row["max_kv_steps"] is None or row["max_kv_steps"] <= row["kv_pass_bound"]
        return row["id_mismatches"] == 0 and row["max_logprob_diff"] <= row["pass_bound"] and kv_ok


# A pass perturbed at the HTP's measured per-op codes moved its top-k log-probs 2-3x as far as the
# HTP did on the main job's SLM graphs, but on the small MTP step passes (0.01-0.05 nats) the HTP
# came up to 1.08x the perturbation: a pass's own bound is twice its perturbation.
NOISE_FACTOR = 2.0


def kv_grid_steps(spec) -> dict[str, float]:
    """Each new K/V output of a graph's io_spec and the step of its grid."""
    return {t.name: float(t.quant["scale"]) for t in spec.outputs if t.role is Role.NEW_KV and t.quant}
