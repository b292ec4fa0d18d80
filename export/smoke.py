"""`smoke`: hybrid drafting through a bundle's context binaries on the QNN HTP backend, compared
with onnxruntime CPU on the bundle's own QDQ graphs.

Only the bundle is read (plus the reference verifier, which is the server's and not part of it).
`verify_bundle` runs first: a flipped byte, a missing LUT or an io_spec that disagrees with a
binary stops the test with one line naming the file. Then, per prompt, R rounds of greedy exact
HyCo drafting (MTP chain + one SLM pass) against the verifier, twice:
- the HTP run: every graph pass runs on the HTP and, on the very same feeds, on CPU; the pass
  agrees when its top-k ids are equal (an id swap counts only as a tie when the two tokens' CPU
  log-probs are within the tolerance) and its sorted top-k log-probs are within the tolerance;
- the CPU run: the same rounds with both drafters on CPU; every round must commit the same
  tokens as the HTP run (greedy exact verification commits the verifier's greedy text, so this
  checks that the drafts were accepted to the same length).
The simulator's pass times are reported as simulation, not as phone speed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from hyco.artifacts import markdown_table, write_json
from hyco.errors import HycoError

TOPK_OUTPUTS = (("topk_logprobs", "topk_indices"), ("topk_logprobs", "topk_ids"))


class PassLog:
    """Per graph role: every pass's HTP-vs-CPU comparison on identical feeds."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self.rows: list[dict[str, Any]] = []

    def record(self, role: str, names, htp, cpu) -> None:
        a, b = dict(zip(names, htp, strict=True)), dict(zip(names, cpu, strict=True))
        lp_name, id_name = next(p for p in TOPK_OUTPUTS if p[0] in a and p[1] in a)
        ids_h, ids_c = np.asarray(a[id_name]), np.asarray(b[id_name])
        lp_h, lp_c = np.asarray(a[lp_name], np.float64), np.asarray(b[lp_name], np.float64)
        mismatches = ties = 0
        for r in range(ids_c.shape[0]):
            cpu_lp = dict(zip(ids_c[r].tolist(), lp_c[r].tolist(), strict=True))
            for j in np.flatnonzero(ids_h[r] != ids_c[r]):
                # the HTP's token at rank j: its CPU log-prob (at most the k-th if outside CPU's top-k)
                other = cpu_lp.get(int(ids_h[r, j]), lp_c[r, -1])
                if abs(lp_c[r, j] - other) <= self.tolerance:
                    ties += 1
                else:
                    mismatches += 1
        kv = [float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in names if n.startswith("new_")]
        self.rows.append({"role": role, "rows": int(ids_c.shape[0]), "id_mismatches": mismatches, "tie_swaps": ties,
                          "top1_equal": int((ids_h[:, 0] == ids_c[:, 0]).sum()),
                          "max_logprob_diff": float(np.abs(lp_h - lp_c).max()),
                          "max_kv_diff": max(kv) if kv else None})

    def ok(self, row: dict[str, Any]) -> bool:
        return row["id_mismatches"] == 0 and row["max_logprob_diff"] <= self.tolerance


class ComparingSession:
    def __init__(self, role: str, htp, cpu, log: PassLog):
        self.role, self.htp, self.cpu, self.log = role, htp, cpu, log

    def run(self, names, feeds):
        htp = self.htp.run(names, feeds)
        self.log.record(self.role, names, htp, self.cpu.run(names, feeds))
        return htp


class ComparingSessions:
    def __init__(self, htp, cpu, log: PassLog):
        self.htp, self.cpu, self.log = htp, cpu, log

    def open(self, key: str):
        return ComparingSession(key.split(".")[0], self.htp.open(key), self.cpu.open(key), self.log)


def run_rounds(prompt: list[int], verifier, drafter, rounds: int, marks: list[int] | None = None,
               log: PassLog | None = None) -> list[list[int]]:
    """R rounds of drafting and verification; the tokens each round commits. With `log`, the
    index of each round's first pass record goes to `marks` (round 0 includes the prefill)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if log is not None:
        marks.append(len(log.rows))
    reply = verifier.prefill(prompt, generator)
    drafter.start(prompt, reply)
    root, committed = reply.root, []
    for r in range(rounds):
        if log is not None and r:
            marks.append(len(log.rows))
        tree = drafter.draft(root)
        reply = verifier.verify_tree(tree, 1.0, generator)
        path = [tree.nodes[i].token for i in reply.verdict.path]
        committed.append(path[1:] + [reply.verdict.bonus])
        drafter.commit(path, reply)
        root = reply.verdict.bonus
    return committed


def smoke(*, bundle: Path, verifier: Path | None, prompts: int, rounds: int, tolerance: float, isolate: bool = True,
          out: Path | None = None) -> dict[str, Any]:
    from hyco.export.bundle import verify_bundle
    from hyco.runtime_check.check import load_model, load_prompts
    from hyco.runtime_check.configs import decode_config
    from hyco.runtime_check.drafters import TreeDrafter
    from hyco.runtime_check.qnn_backend import BundleSessions, mtp_qnn, slm_qnn
    from hyco.runtime_check.verifier import ReferenceVerifier, Sampling
    from hyco.vocab.keepset import load_keep_set
    from transformers import AutoTokenizer

    from hyco.io_spec import read_io_spec
    from hyco.recipe import CheckConfig, DatasetConfig

    bundle = Path(bundle)
    start = time.perf_counter()
    meta = verify_bundle(bundle)
    shared = sorted(r for r, g in meta["graphs"].items() if g.get("shared_context"))
    if shared:
        raise HycoError(f"{bundle / 'bundle.json'}: {' and '.join(shared)} share one context binary (unverified); the x86 "
                        "HTP simulator cannot load a shared context, so smoke cannot run it (load it on a device)")
    verifier = Path(verifier) if verifier else (Path(meta["reference_verifier"]) if meta.get("reference_verifier") else None)
    if verifier is None:
        raise HycoError(f"{bundle / 'bundle.json'}: names no reference verifier; pass --verifier DIR")
    if not (bundle / "prompts.jsonl").is_file():
        raise HycoError(f"{bundle / 'prompts.jsonl'}: the bundle ships no smoke prompts")
    import torch

    tok = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    keep_ids = torch.from_numpy(load_keep_set(bundle, tok).token_ids.astype(np.int64))
    specs = read_io_spec(bundle / "io_spec.json")
    tree_meta, mtp_meta = specs["tree.qdq.onnx"].meta, specs["mtp_step.qdq.onnx"].meta
    ring_full = max(r["slots"] for r in tree_meta["rings"])
    prompt_ids = load_prompts(tok, vocab_dir=bundle, dataset=DatasetConfig(), count=prompts)
    model = load_model(verifier, "verifier")
    cfg = decode_config("hyco-exact", CheckConfig(temperature=0.0))
    sampling = Sampling(temperature=0.0)
    htp, cpu = BundleSessions(bundle, backend="qnn", isolate=isolate), BundleSessions(bundle, backend="cpu", isolate=False)
    log = PassLog(tolerance)
    results = []
    try:
        for i, prompt in enumerate(prompt_ids):
            runs = {}
            for name, sessions in (("htp", ComparingSessions(htp, cpu, log)), ("cpu", cpu)):
                def drafter(sessions=sessions):
                    mtp = mtp_qnn(bundle, keep_ids=keep_ids, window=int(mtp_meta["window"]),
                                  capture_point=mtp_meta.get("capture_point", "after_norm"), quantize_wire=True,
                                  sessions=sessions)
                    slm = slm_qnn(bundle, keep_ids=keep_ids, max_prompt=int(tree_meta["max_prompt"]),
                                  ring_full=ring_full, sessions=sessions)
                    return TreeDrafter(cfg, mtp, slm)
                verifier_run = ReferenceVerifier(model, sampling, capture_point=mtp_meta.get("capture_point", "after_norm"),
                                                 window=int(mtp_meta["window"]))
                marks: list[int] = []
                runs[name] = run_rounds(prompt, verifier_run, drafter(), rounds, marks, log if name == "htp" else None)
                if name == "htp":
                    bounds = marks + [len(log.rows)]
            for r in range(rounds):
                passes = log.rows[bounds[r]:bounds[r + 1]]
                results.append({"prompt": i, "round": r, "passes": len(passes),
                                "passes_agree": all(log.ok(p) for p in passes),
                                "htp_committed": runs["htp"][r], "cpu_committed": runs["cpu"][r],
                                "same_commit": runs["htp"][r] == runs["cpu"][r]})
        timings = {"htp (simulation, not phone speed)": htp.timings(), "cpu (onnxruntime, QDQ)": cpu.timings()}
    finally:
        htp.close()
    bad_passes = [p for p in log.rows if not log.ok(p)]
    passed = not bad_passes and all(r["same_commit"] and r["passes_agree"] for r in results)
    by_role = {}
    for role in sorted({p["role"] for p in log.rows}):
        rows = [p for p in log.rows if p["role"] == role]
        by_role[role] = {"passes": len(rows), "rows": sum(p["rows"] for p in rows),
                         "id_mismatches": sum(p["id_mismatches"] for p in rows),
                         "tie_swaps": sum(p["tie_swaps"] for p in rows),
                         "top1_equal": sum(p["top1_equal"] for p in rows),
                         "max_logprob_diff": round(max(p["max_logprob_diff"] for p in rows), 5),
                         "max_kv_diff": round(max((p["max_kv_diff"] or 0.0) for p in rows), 5)}
    headline = (f"smoke {'PASSED' if passed else 'FAILED'}: {len(prompt_ids)} prompts x {rounds} rounds, "
                f"{len(log.rows)} graph passes on the QNN HTP simulator vs onnxruntime CPU, "
                f"{len(bad_passes)} disagreeing (tolerance {tolerance}), "
                f"{sum(not r['same_commit'] for r in results)} rounds with other committed tokens")
    report = {"passed": passed, "headline": headline, "bundle": str(bundle), "verifier": str(verifier),
              "soc_model": meta["soc_model"], "tolerance": tolerance, "isolate": isolate,
              "isolation_note": "each HTP context in its own worker process (results were seen to leak between "
                                "HTP sessions in one process)" if isolate else "all contexts in one process",
              "by_graph": by_role, "rounds": results, "timings": timings, "passes": log.rows,
              "wall_s": round(time.perf_counter() - start, 2)}
    md = f"## smoke on `{bundle}`\n\n{headline}.\n\n"
    md += markdown_table([{"graph": k, **v} for k, v in by_role.items()],
                         ["graph", "passes", "rows", "id_mismatches", "tie_swaps", "top1_equal", "max_logprob_diff",
                          "max_kv_diff"])
    md += "\nTimes (the HTP figures are the x86 simulator's, not phone speed):\n\n"
    md += markdown_table([{"backend": b, "graph": g, **v} for b, t in timings.items() for g, v in t.items()],
                         ["backend", "graph", "load_s", "passes", "pass_s_mean", "pass_s_max"])
    report["summary_md"] = md
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json(Path(out) / "report.json", report)
        (Path(out) / "summary.md").write_text(md)
    return report
