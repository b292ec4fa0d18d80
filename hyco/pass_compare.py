"""The rule by which an HTP pass agrees with the CPU EP's pass on the same feeds (smoke, check on
the bundle, calibrate's simulator check): top-k ids equal (a swap counts only as a tie within the
bound) and top-k log-probs within the graph's bound."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyco.io_spec import Role, role_of

TOPK_OUTPUTS = (("topk_logprobs", "topk_indices"), ("topk_logprobs", "topk_ids"))


class PassLog:
    """Per graph role: every pass's HTP-vs-CPU comparison on identical feeds. `tolerance`: one
    bound for every graph, or a bound per graph role."""

    def __init__(self, tolerance: float | dict[str, float]):
        self.tolerance = tolerance
        self.rows: list[dict[str, Any]] = []

    def bound(self, role: str) -> float:
        return self.tolerance[role] if isinstance(self.tolerance, dict) else self.tolerance

    def record(self, role: str, names, htp, cpu, active: int | None = None) -> None:
        """`active`: only the first rows are compared (the SLM graphs' padding rows, which see only
        themselves and are never read, carry no draft; their near-ties would count as tie swaps)."""
        bound = self.bound(role)
        a, b = dict(zip(names, htp, strict=True)), dict(zip(names, cpu, strict=True))
        lp_name, id_name = next(p for p in TOPK_OUTPUTS if p[0] in a and p[1] in a)
        ids_h, ids_c = np.asarray(a[id_name])[:active], np.asarray(b[id_name])[:active]
        lp_h, lp_c = np.asarray(a[lp_name], np.float64)[:active], np.asarray(b[lp_name], np.float64)[:active]
        mismatches = ties = 0
        for r in range(ids_c.shape[0]):
            cpu_lp = dict(zip(ids_c[r].tolist(), lp_c[r].tolist(), strict=True))
            for j in np.flatnonzero(ids_h[r] != ids_c[r]):
                # the HTP's token at rank j: its CPU log-prob (at most the k-th if outside CPU's top-k)
                other = cpu_lp.get(int(ids_h[r, j]), lp_c[r, -1])
                if abs(lp_c[r, j] - other) <= bound:
                    ties += 1
                else:
                    mismatches += 1
        kv = [float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in names if role_of(n) is Role.NEW_KV]
        self.rows.append({"role": role, "rows": int(ids_c.shape[0]), "id_mismatches": mismatches, "tie_swaps": ties,
                          "top1_equal": int((ids_h[:, 0] == ids_c[:, 0]).sum()), "bound": bound,
                          "ids_equal_rows": int((ids_h == ids_c).all(-1).sum()),
                          "max_logprob_diff": float(np.abs(lp_h - lp_c).max()),
                          "max_kv_diff": max(kv) if kv else None})

    def ok(self, row: dict[str, Any]) -> bool:
        return row["id_mismatches"] == 0 and row["max_logprob_diff"] <= row["bound"]
