"""`smoke`: hybrid drafting through a bundle's context binaries on the QNN HTP backend, compared
with onnxruntime CPU on the bundle's own QDQ graphs.

Only the bundle is read (plus the reference verifier, which is the server's and not part of it).
`verify_bundle` runs first: a flipped byte, a missing LUT or an io_spec that disagrees with a
binary stops the test with one line naming the file. Then, per prompt, R rounds of exact HyCo
drafting (MTP chain + one SLM pass) against the verifier, which samples at the paper's settings
(temperature 1, top-k 64, top-p 0.95) with each token drawn from a generator keyed by its
position, twice:
- the HTP run: every graph pass runs on the HTP and, on the very same feeds, on CPU; the pass
  agrees when its top-k ids are equal (an id swap counts only as a tie when the two tokens' CPU
  log-probs are within twice the pass's own measured difference, `pass_compare`), its top-k
  log-probs are within the graph's bound and the new K/V rows it writes are within the graph's
  K/V bound, in steps of their 8-bit grid. The bounds are per graph, from the bundle's io_spec
  (`htp_logprob_bound`, `htp_kv_step_bound`, written by calibrate): how far the graph's
  top-k log-probs (K/V rows) move when each op's output is moved as the HTP moved it: as many
  elements as its measured mean says, each by its measured worst codes at that tensor
  (`evaluate.perturbation_bound`). The report states each bound over the HTP's own difference and
  names a graph whose bound sits over `POWER_LIMIT` times it, with the reason. The HTP and
  onnxruntime are two integer implementations of the same 16-bit grids that round differently in
  every op, by a few codes; a kernel that computes wrong numbers (the Log trap: 2 nats; the
  softcap's Tanh) or one activation read on a grid twice off lands outside the bounds. Each pass
  also runs on the CPU graph perturbed at those measured codes (`NoisySessions`, 2 draws): a
  prompt more sensitive than calibrate's passes may move up to twice its own perturbation
  (`pass_compare.NOISE_FACTOR`), so an honest HTP is not failed on it.
  `--tolerance` replaces the log-prob bound with one number for every graph (and holds no K/V
  bound);
- the CPU run: the same rounds with both drafters on CPU (`compare_commits`). Exact
  verification with position-keyed sampling commits the verifier's own sampled text whatever the
  drafts, so the two runs' committed streams must agree token for token over their common length. A round may accept a different
  number of drafts only where its passes swapped two tokens within the bound (a tie: the drafts
  then legitimately differ); such a round is counted and reported, and from it on the two runs
  stand at different positions, so rounds are compared as streams, not one by one.
The simulator's pass times are reported as simulation, not as phone speed.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.data.answers import MAX_TOP_SHARE, text_stats
from hyco.pipeline.artifacts import markdown_table
from hyco.quant.pass_compare import PassLog, kv_grid_steps

# Reported per graph: the share of rows whose HTP top-1 equals the CPU's (the tiny main job's bundle,
# 4 prompts x 3 rounds: tree 97/100, prefill 208/211, MTP 48/48; a prefill graph whose softcap the
# HTP computed wrong, 16/109). Held only through the tie rule (a top-1 swap beyond a tie is a
# mismatch): random-weight families' flat rows swap their top-1 within a tie honestly.
TOP1_FLOOR = 0.9


class ComparingSession:
    def __init__(self, role: str, htp, cpu, log: PassLog, noisy: list | None = None):
        self.role, self.htp, self.cpu, self.log, self.noisy = role, htp, cpu, log, noisy or []
        self.active_rows: int | None = None  # set by the SLM drafter before each pass

    def run(self, names, feeds):
        # The HTP's pass (the simulator, in its own worker process) and the CPU's passes on the same
        # feeds need nothing from each other: side by side they take the longer, not the sum.
        pending = htp_side().submit(self.htp.run, names, feeds)
        cpu = self.cpu.run(names, feeds)
        noisy = [s.run(names, feeds) for s in self.noisy]
        htp = pending.result()
        self.log.record(self.role, names, htp, cpu, self.active_rows, noisy=noisy)
        self.active_rows = None
        return htp


_htp_side: concurrent.futures.ThreadPoolExecutor | None = None


def htp_side() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for the HTP's passes, made on first use and kept for the process."""
    global _htp_side
    if _htp_side is None:
        _htp_side = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="htp-pass")
    return _htp_side


class ComparingSessions:
    def __init__(self, htp, cpu, log: PassLog, noisy: NoisySessions | None = None):
        self.htp, self.cpu, self.log, self.noisy = htp, cpu, log, noisy

    def open(self, key: str):
        return ComparingSession(key.split(".")[0], self.htp.open(key), self.cpu.open(key), self.log,
                                self.noisy.open(key) if self.noisy else None)


class NoisySessions:
    """Per graph, the bundle's CPU reference graph with every activation moved by seeded random
    codes up to the HTP's measured worst at that tensor (io_spec `htp_op_codes`, from calibrate's
    op-by-op run; `hyco.quant.perturb.perturbed_model`), `draws` of them: run on each pass's own feeds, they
    say how far a correct HTP could move that pass. None for a graph calibrated without the
    simulator."""

    def __init__(self, bundle: Path, specs: dict, draws: int = 2):
        self.bundle, self.specs, self.draws = bundle, specs, draws
        self.opened: dict[str, list] = {}

    def open(self, key: str) -> list:
        if key not in self.opened:
            import onnx

            from hyco.qnn.ort import session_for
            from hyco.quant.perturb import perturbed_model
            from hyco.runtime.qnn_backend import CodesSession

            codes = self.specs[key].meta.get("htp_op_codes")
            path = self.bundle / "reference" / key
            model = onnx.load(str(path), load_external_data=False) if codes else None
            rates = self.specs[key].meta.get("htp_op_rates")  # None in a bundle calibrated before them: every element
            self.opened[key] = [CodesSession(session_for(perturbed_model(model, d, codes, rates), path.parent, arena=False),
                                             self.specs[key]) for d in range(self.draws)] if codes else []
        return self.opened[key]


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


def run_bridged_rounds(prompt: list[int], slm_prompt: list[int], verifier, drafter, bridge, rounds: int,
                       eos_ids: set[int], marks: list[int] | None = None, log: PassLog | None = None) -> list[list[int]]:
    """`run_rounds` through the token bridge (a verifier of another family; SLM-only trees): the
    verifier tokens each round commits."""
    import torch

    from hyco.runtime.decode import decode_bridged

    def mark(done: int) -> bool:  # round 0's mark is taken before the prefill
        if log is not None and 0 < done < rounds:
            marks.append(len(log.rows))
        return done < rounds

    if log is not None:
        marks.append(len(log.rows))
    decoded = decode_bridged((prompt, slm_prompt), verifier, drafter, bridge, epsilon=1.0, max_new_tokens=1 << 30,
                             eos_ids=eos_ids, generator=torch.Generator().manual_seed(0), on_round=mark)
    committed, at = [], 1  # the first token is the prefill's
    for r in decoded.rounds:
        committed.append(decoded.tokens[at:at + r.committed])
        at += r.committed
    return committed


def compare_commits(htp: list[list[int]], cpu: list[list[int]], tie_swaps: list[int]) -> list[dict[str, Any]]:
    """Per round of one prompt: both runs' commits, whether they are equal, whether the committed
    streams so far agree over their common length (`stream_agrees`), and whether a difference is
    explained by a tie swap in that round's passes (`explained`). A round is `ok` when the
    streams agree and its commits are equal or explained."""
    rows, stream_h, stream_c = [], [], []
    if len(htp) != len(cpu):  # one run ended its text (EOS) in another round than the other
        rows.append({"htp_committed": htp, "cpu_committed": cpu, "same_commit": False, "stream_agrees": False,
                     "tie_swaps": 0, "explained": False, "ok": False})
        return rows
    for r, (h, c) in enumerate(zip(htp, cpu, strict=True)):
        stream_h += h
        stream_c += c
        n = min(len(stream_h), len(stream_c))
        same, agrees = h == c, stream_h[:n] == stream_c[:n]
        explained = same or tie_swaps[r] > 0
        rows.append({"htp_committed": h, "cpu_committed": c, "same_commit": same, "stream_agrees": agrees,
                     "tie_swaps": tie_swaps[r], "explained": explained, "ok": agrees and explained})
    return rows


def graph_bounds(bundle: Path, specs: dict) -> dict[str, float]:
    """Per graph role, the log-prob bound calibrate wrote into io_spec (meta `htp_logprob_bound`:
    how far the HTP's own per-op differences, measured op by op, move the graph's top-k
    log-probs; `evaluate.perturbation_bound`)."""
    return {role: float(v) for role, v in _meta_per_role(bundle, specs, "htp_logprob_bound").items()}


def kv_bounds(bundle: Path, specs: dict) -> dict[str, float | None]:
    """Per graph role, how many steps of their 8-bit grids the new K/V rows may land apart (meta
    `htp_kv_step_bound`, same derivation; None: a graph that writes no K/V)."""
    return _meta_per_role(bundle, specs, "htp_kv_step_bound")


def _meta_per_role(bundle: Path, specs: dict, key: str) -> dict[str, Any]:
    found = {}
    for name, spec in specs.items():
        if key not in spec.meta:
            raise HycoError(f"{bundle / 'io_spec.json'}: graph {name} has no {key} (calibrated "
                            "before that bound was recorded); pass --tolerance or re-run calibrate")
        found[name.split(".")[0]] = spec.meta[key]
    return found


SMOKE_SEED = 0  # the verifier's position-keyed sampling


def choose_prompts(reference_verifier, candidates: list[list[int]], count: int, length: int) -> list[dict[str, Any]]:
    """Each candidate's reference text (the verifier's own continuation, `length` tokens, sampled
    as the smoke run's verification samples it) with its statistics; the first `count` whose text
    is not degenerate are chosen, then, when too few are, the least degenerate others. Agreement
    measured on one repeated token says nothing."""
    from hyco.runtime.tree import DraftTree

    rows = []
    for i, prompt in enumerate(candidates):
        verifier = reference_verifier()
        token = verifier.prefill(prompt, None).root
        text = [token]
        while len(text) < length:
            token = verifier.verify_tree(DraftTree(token), 1.0, None).root
            text.append(token)
        stats = text_stats([text])
        rows.append({"candidate": i, "tokens": stats["tokens"], "distinct_tokens": stats["distinct_tokens"],
                     "top_share": stats["top_share"], "degenerate": stats["top_share"] > MAX_TOP_SHARE,
                     "chosen": False})
    for row in sorted(rows, key=lambda r: (r["degenerate"], r["top_share"] if r["degenerate"] else 0, r["candidate"]))[:count]:
        row["chosen"] = True
    return rows


def check_verifier(bundle: Path, recorded: dict | None, verifier: Path) -> None:
    """The verifier given must be the one the bundle was exported against (its config's sha256, as
    bundle.json records it): drafting against another model tests nothing the bundle promised."""
    from hyco.base.files import sha256_file

    config = verifier / "config.json"
    if not config.is_file():
        raise HycoError(f"{config}: not found (reference verifier)")
    if recorded and recorded.get("config_sha256") != sha256_file(config):
        raise HycoError(f"{config}: not the reference verifier {bundle / 'bundle.json'} records "
                        f"({recorded.get('name')}, config sha256 {str(recorded.get('config_sha256'))[:12]}...)")


def smoke(*, bundle: Path, verifier: Path, prompts: int, rounds: int, tolerance: float | None = None,
          isolate: bool = True, out: Path | None = None, named_as: Path | None = None,
          soc_model: int | None = None, verifier_tokenizer: Path | None = None) -> dict[str, Any]:
    """`tolerance` None: each graph is held to its own bound from the bundle's io_spec
    (`graph_bounds`); a number: that bound for every graph. `named_as`: the bundle's folder as the
    reports name it (export builds the bundle in a temp folder). `soc_model`: the SoC the smoke
    run is for; a bundle built for another is refused. A bundle without an MTP step graph drafts
    SLM-only trees (SpecEdge-style, exact); `verifier_tokenizer`: a verifier of another family,
    drafted for through the token bridge (hyco/runtime/bridge.py)."""
    from hyco.runtime.configs import decode_config
    from hyco.runtime.qnn_backend import BundleSessions

    bundle, verifier = Path(bundle), Path(verifier)
    start = time.perf_counter()
    opened = open_bundle(bundle, verifier, soc_model, prompts, verifier_tokenizer)
    cfg = decode_config("hyco-exact" if opened["has_mtp"] else "specedge", opened["check"])
    candidates = opened["candidates"]
    selection = choose_prompts(opened["reference_verifier"], candidates, prompts, rounds * (cfg.mtp_depth + 1))
    chosen = [row["candidate"] for row in selection if row["chosen"]]
    prompt_ids = [candidates[i] for i in chosen]
    opened["slm_prompts"] = [opened["slm_candidates"][i] for i in chosen]
    specs = opened["specs"]
    htp = BundleSessions(bundle, backend="qnn", isolate=isolate).prestart()
    cpu = BundleSessions(bundle, backend="cpu", isolate=False)
    graph_bound = graph_bounds(bundle, specs) if tolerance is None else dict.fromkeys(
        (k.split(".")[0] for k in specs), float(tolerance))
    log = PassLog(graph_bound, kv_steps={k.split(".")[0]: kv_grid_steps(spec) for k, spec in specs.items()},
                  kv_bound=kv_bounds(bundle, specs) if tolerance is None else None)
    try:
        results = run_prompts(prompt_ids, rounds, bundle, opened, cfg, htp, cpu, log, NoisySessions(bundle, specs))
        timings = {"htp (simulation, not phone speed)": htp.timings(), "cpu (onnxruntime, QDQ)": cpu.timings()}
    finally:
        htp.close()
    bad_passes = [p for p in log.rows if not log.ok(p)]
    by_role = pass_totals(log, graph_bound)
    bound_power(by_role, {k.split(".")[0]: next((float(t.quant["scale"]) for t in spec.outputs
                                                  if t.name.startswith("topk_logprobs") and t.quant), None)
                          for k, spec in specs.items()})
    low_top1 = below_top1_floor(by_role)  # reported: random-weight families swap top-1 on flat rows honestly
    passed = not bad_passes and all(r["ok"] and r["passes_agree"] for r in results)
    diverged = sum(not r["same_commit"] for r in results)
    # the text the rounds ran on: a prompt whose answer loops on one token drafts trivially
    committed = {i: sum((r["cpu_committed"] for r in results if r["prompt"] == i), []) for i in range(len(prompt_ids))}
    text = {i: text_stats([ids]) for i, ids in committed.items()}
    looping = sum(t["top_share"] > MAX_TOP_SHARE for t in text.values())  # a few rounds: too short for "distinct"
    headline = (f"smoke {'PASSED' if passed else 'FAILED'}: {len(prompt_ids)} prompts x {rounds} rounds, "
                f"{len(log.rows)} graph passes on the QNN HTP simulator vs onnxruntime CPU, "
                f"{len(bad_passes)} disagreeing (log-prob bound per graph {graph_bound}, K/V step bound "
                f"{log.kv_bound if log.kv_bound is not None else 'not held'}, ties within twice "
                f"each pass's measured difference), top-1 below {TOP1_FLOOR:.0%} of rows (reported, not held) on {low_top1 or 'no graph'}, "
                f"committed streams {'agree' if all(r['stream_agrees'] for r in results) else 'DIFFER'}, "
                f"{diverged} rounds accepting another number of drafts "
                f"({sum(not r['same_commit'] and r['explained'] for r in results)} through a tie swap); "
                f"committed text (the verifier's sampled text, position-keyed) more than {MAX_TOP_SHARE:.0%} one "
                f"token on {looping} of {len(text)} prompts, chosen from {len(selection)} by their reference text")
    report = {"passed": passed, "headline": headline, "bundle": str(named_as or bundle), "verifier": str(verifier),
              "drafting": cfg.name + (" through the token bridge" if opened["bridge"] else ""),
              "soc_model": opened["meta"]["soc_model"], "tolerance": tolerance, "bounds": graph_bound,
              "isolate": isolate,
              "isolation_note": "each HTP context in its own worker process (results were seen to leak between "
                                "HTP sessions in one process)" if isolate else "all contexts in one process",
              "by_graph": by_role, "rounds": results, "committed_text": text, "looping_prompts": looping,
              "prompt_selection": selection, "timings": timings, "passes": log.rows,
              "wall_s": round(time.perf_counter() - start, 2)}
    report["summary_md"] = smoke_markdown(report, prompts, rounds * (cfg.mtp_depth + 1))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json(Path(out) / "report.json", report)
        (Path(out) / "summary.md").write_text(report["summary_md"])
    return report


def open_bundle(bundle: Path, verifier: Path, soc_model: int | None, prompts: int,
                verifier_tokenizer: Path | None = None) -> dict[str, Any]:
    """The verified bundle (refused: another SoC, a shared context, another verifier, no prompts),
    its tokenizer, keep set, io_spec and candidate prompts (the verifier's, and the SLM's: the
    same unless `verifier_tokenizer`, then with the token bridge between them), and the reference
    verifier."""
    import torch
    from transformers import AutoTokenizer

    from hyco.config.recipe import CheckConfig, DatasetConfig
    from hyco.data.keepset import load_keep_set
    from hyco.data.workloads import chat_ids
    from hyco.npu.io_spec import read_io_spec
    from hyco.qnn.bundle import verify_bundle
    from hyco.runtime.inputs import load_model, load_prompt_texts
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    meta = verify_bundle(bundle, soc_model)
    shared = sorted(r for r, g in meta["graphs"].items() if g.get("shared_context"))
    if shared:
        raise HycoError(f"{bundle / 'bundle.json'}: {' and '.join(shared)} share one context binary (unverified); the x86 "
                        "HTP simulator cannot load a shared context, so smoke cannot run it (load it on a device)")
    check_verifier(bundle, meta.get("reference_verifier"), verifier)
    if not (bundle / "prompts.jsonl").is_file():
        raise HycoError(f"{bundle / 'prompts.jsonl'}: the bundle ships no smoke prompts")
    tok = AutoTokenizer.from_pretrained(bundle / "tokenizer")
    keep_ids = torch.from_numpy(load_keep_set(bundle, tok).token_ids.astype(np.int64))
    specs = read_io_spec(bundle / "io_spec.json")
    texts = load_prompt_texts(vocab_dir=bundle, dataset=DatasetConfig(), count=prompts, all_available=True)
    slm_candidates = [chat_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    model = load_model(verifier, "verifier")
    bridge, candidates, eos = None, slm_candidates, set()
    if verifier_tokenizer is not None:
        from hyco.data.answers import eos_ids_of
        from hyco.runtime.bridge import TokenBridge, end_of_turn_ids

        verifier_tok = AutoTokenizer.from_pretrained(verifier_tokenizer)
        eos = set(eos_ids_of(model))
        if not eos:
            raise HycoError(f"{verifier}/generation_config.json: no eos_token_id (the verifier's end of turn)")
        bridge = TokenBridge(tok, verifier_tok, slm_eos=end_of_turn_ids(tok), verifier_eos=eos_ids_of(model)[0])
        candidates = [chat_ids(verifier_tok, [{"role": "user", "content": t}]) for t in texts]
    check = CheckConfig()  # the paper's sampling (T 1, top-k 64, top-p 0.95) and tree
    sampling = Sampling(check.temperature, check.top_k, check.top_p)
    has_mtp = "mtp_step.qdq.onnx" in specs
    if bridge is not None and has_mtp:
        raise HycoError(f"{bundle / 'io_spec.json'}: the bundle ships an MTP Drafter, which drafts in the SLM's "
                        "vocabulary for a head of its own family; the token bridge drafts SLM-only trees")
    mtp_meta = specs["mtp_step.qdq.onnx"].meta if has_mtp else {}

    def reference_verifier():
        return ReferenceVerifier(model, sampling, capture_point=mtp_meta.get("capture_point", "after_norm"),
                                 window=int(mtp_meta["window"]) if has_mtp else None, keyed_seed=SMOKE_SEED,
                                 hand_off=has_mtp)

    return {"meta": meta, "keep_ids": keep_ids, "specs": specs, "candidates": candidates,
            "slm_candidates": slm_candidates, "check": check, "reference_verifier": reference_verifier,
            "has_mtp": has_mtp, "bridge": bridge, "eos": eos}


def run_prompts(prompt_ids: list[list[int]], rounds: int, bundle: Path, opened: dict[str, Any], cfg, htp, cpu,
                log: PassLog, noisy: NoisySessions | None = None) -> list[dict[str, Any]]:
    """Per prompt, the rounds twice: every pass on the HTP and on the CPU (`ComparingSessions`,
    recorded in `log`), then with both drafters on the CPU; the two committed streams compared."""
    from hyco.runtime.drafters import TreeDrafter
    from hyco.runtime.qnn_backend import mtp_qnn, slm_qnn

    specs, keep_ids, bridge = opened["specs"], opened["keep_ids"], opened["bridge"]
    tree_meta = specs["tree.qdq.onnx"].meta
    mtp_meta = specs["mtp_step.qdq.onnx"].meta if opened["has_mtp"] else None
    ring_full = max(r["slots"] for r in tree_meta["rings"])
    results = []
    for i, prompt in enumerate(prompt_ids):
        runs = {}
        for name, sessions in (("htp", ComparingSessions(htp, cpu, log, noisy)), ("cpu", cpu)):
            verifier_run = opened["reference_verifier"]()
            mtp = None if mtp_meta is None else mtp_qnn(
                bundle, keep_ids=keep_ids, window=int(mtp_meta["window"]),
                capture_point=mtp_meta.get("capture_point", "after_norm"), quantize_wire=True, sessions=sessions)
            slm = slm_qnn(bundle, keep_ids=keep_ids, max_prompt=int(tree_meta["max_prompt"]), ring_full=ring_full,
                          sessions=sessions)
            marks: list[int] = []
            recorded = log if name == "htp" else None
            if bridge is None:
                runs[name] = run_rounds(prompt, verifier_run, TreeDrafter(cfg, mtp, slm), rounds, marks, recorded)
            else:
                runs[name] = run_bridged_rounds(prompt, opened["slm_prompts"][i], verifier_run,
                                                TreeDrafter(cfg, None, slm), bridge, rounds, opened["eos"], marks,
                                                recorded)
            if name == "htp":
                bounds = marks + [len(log.rows)]
        per_round = [log.rows[bounds[r]:bounds[r + 1]] for r in range(len(bounds) - 1)]
        # rounds of unequal count (one run ended its text earlier): one failed row (`compare_commits`)
        commits = compare_commits(runs["htp"], runs["cpu"], [sum(p["tie_swaps"] for p in ps) for ps in per_round])
        for r, (passes, commit) in enumerate(zip(per_round, commits, strict=False)):
            results.append({"prompt": i, "round": r, "passes": len(passes),
                            "passes_agree": all(log.ok(p) for p in passes), **commit})
    return results


def below_top1_floor(by_role: dict[str, dict[str, Any]]) -> list[str]:
    """The graphs whose HTP top-1 equals the CPU's on fewer than TOP1_FLOOR of their rows."""
    return sorted(role for role, v in by_role.items() if v["top1_share"] < TOP1_FLOOR)


def pass_totals(log: PassLog, graph_bound: dict[str, float]) -> dict[str, dict[str, Any]]:
    by_role = {}
    for role in sorted({p["role"] for p in log.rows}):
        rows = [p for p in log.rows if p["role"] == role]
        by_role[role] = {"passes": len(rows), "rows": sum(p["rows"] for p in rows),
                         "id_mismatches": sum(p["id_mismatches"] for p in rows),
                         "tie_swaps": sum(p["tie_swaps"] for p in rows),
                         "top1_equal": sum(p["top1_equal"] for p in rows),
                         "top1_share": round(sum(p["top1_equal"] for p in rows) / max(1, sum(p["rows"] for p in rows)), 4),
                         "widest_tie_nats": round(max(p["widest_tie_nats"] for p in rows), 5),
                         "max_logprob_diff": round(max(p["max_logprob_diff"] for p in rows), 5),
                         "bound": round(graph_bound[role], 5),
                         "max_kv_diff": round(max((p["max_kv_diff"] or 0.0) for p in rows), 5),
                         "max_kv_steps": round(max((p.get("max_kv_steps") or 0.0) for p in rows), 2),
                         "kv_step_bound": rows[0].get("kv_step_bound"),
                         "max_noise_logprob": _max_of(rows, "noise_logprob"),
                         "max_pass_bound": _max_of(rows, "pass_bound"),
                         "max_htp_over_noise": _max_ratio(rows, "max_logprob_diff", "noise_logprob"),
                         "max_noise_kv_steps": _max_of(rows, "noise_kv_steps"),
                         "max_kv_over_noise": _max_ratio(rows, "max_kv_steps", "noise_kv_steps")}
    return by_role


# A bound more than this many times the HTP's own difference lets a fault that large pass: the
# report says per graph where one is, and why.
POWER_LIMIT = 5.0


def bound_power(by_role: dict[str, dict[str, Any]], logprob_steps: dict[str, float | None]) -> None:
    """Per graph, each bound over the HTP's measured difference on these passes (`*_over_htp`),
    and where one is over POWER_LIMIT the reason (`power_note`): the HTP matched the CPU to the
    output grid's resolution (one step of the top-k log-probs' grid, one K/V step), or the
    perturbation at the HTP's measured codes moved this graph further than the HTP did here."""
    for role, v in by_role.items():
        step = logprob_steps.get(role) or 0.0
        v["bound_over_htp"] = round(v["bound"] / max(v["max_logprob_diff"], step, 1e-9), 2)
        v["kv_bound_over_htp"] = (round(v["kv_step_bound"] / max(v["max_kv_steps"], 1.0), 2)
                                  if v.get("kv_step_bound") else None)
        notes = []
        for what, ratio, measured, resolution in (("log-prob", v["bound_over_htp"], v["max_logprob_diff"], 2 * step),
                                                  ("K/V", v["kv_bound_over_htp"], v["max_kv_steps"], 1.0)):
            if ratio is None or ratio <= POWER_LIMIT:
                continue
            notes.append(f"{what} bound {ratio:g}x the HTP's difference: " + (
                "the HTP matched the CPU to the output grid's resolution on these passes" if measured <= resolution
                else "the perturbation at the HTP's measured codes moves this graph further than the HTP did here"))
        v["power_note"] = "; ".join(notes) or None


def _max_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(max(values), 5) if values else None


def _max_ratio(rows: list[dict], top: str, bottom: str) -> float | None:
    """The largest per-pass top / bottom (a bottom under 1e-6 counts as 1e-6)."""
    values = [r[top] / max(r[bottom], 1e-6) for r in rows if r.get(bottom) is not None and r.get(top) is not None]
    return round(max(values), 3) if values else None


def smoke_markdown(report: dict[str, Any], prompts: int, reference_tokens: int) -> str:
    selection, text, results = report["prompt_selection"], report["committed_text"], report["rounds"]
    md = f"## smoke on `{report['bundle']}`\n\n{report['headline']}.\n\n"
    md += markdown_table([{"graph": k, **v} for k, v in report["by_graph"].items()],
                         ["graph", "passes", "rows", "id_mismatches", "tie_swaps", "widest_tie_nats", "top1_equal",
                          "top1_share", "max_logprob_diff", "bound", "max_noise_logprob", "max_pass_bound",
                          "max_kv_steps", "kv_step_bound", "max_noise_kv_steps", "bound_over_htp", "kv_bound_over_htp"])
    weak = {k: v["power_note"] for k, v in report["by_graph"].items() if v.get("power_note")}
    md += (f"\nPower: each bound over the HTP's own difference on these passes (bound_over_htp, kv_bound_over_htp); "
           f"a fault under a bound passes, so a bound over {POWER_LIMIT:g}x is named: "
           + ("; ".join(f"{k}: {n}" for k, n in weak.items()) if weak else "none is") + ".\n")
    md += ("\nA pass agrees when its top-k ids are equal but for swaps of tokens whose CPU log-probs are within "
           "twice the pass's own HTP-vs-CPU difference (hyco/quant/pass_compare.py: no honest swap crosses a wider gap) "
           "and every log-prob both top-k rows hold, rank by rank and token by token, is within the graph's bound "
           "or twice the pass's own move when perturbed at the HTP's measured codes (max_pass_bound), "
           "and the new K/V rows it writes are within the graph's K/V bound (max_kv_steps, in steps of their "
           "8-bit grid). Both bounds come from calibrate (`htp_logprob_bound`, `htp_kv_step_bound`): how far "
           "the HTP's own measured per-op differences (as many elements as its mean, each by its worst) move the graph. "
           "A top-1 swap beyond a tie is a "
           f"mismatch, so every decisive row's top-1 is held equal; top1_share over all rows (under {TOP1_FLOOR:.0%} "
           "flagged in the headline) is reported, since flat rows swap their top-1 within a tie honestly.\n")
    md += (f"\nPrompts: the first {prompts} of the bundle's {len(selection)} evaluation prompts whose reference "
           f"text (the verifier's own sampled continuation, {reference_tokens} tokens, T 1, top-k 64, "
           f"top-p 0.95, each token keyed by its position) is at most {MAX_TOP_SHARE:.0%} one token; "
           f"{sum(r['chosen'] and r['degenerate'] for r in selection)} chosen ones fall short of that (too few "
           "candidates pass).\n\n")
    md += markdown_table(selection, ["candidate", "tokens", "distinct_tokens", "top_share", "degenerate", "chosen"])
    md += "\nCommitted text per prompt (CPU run; a looping answer drafts trivially):\n\n"
    md += markdown_table([{"prompt": i, **v} for i, v in text.items()],
                         ["prompt", "tokens", "distinct_tokens", "top_token", "top_share"])
    md += "\nRounds (tokens each run committed; a different count needs a tie swap in that round):\n\n"
    md += markdown_table([{**r, "htp_committed": len(r["htp_committed"]), "cpu_committed": len(r["cpu_committed"])}
                          for r in results],
                         ["prompt", "round", "passes", "passes_agree", "htp_committed", "cpu_committed", "tie_swaps",
                          "stream_agrees", "ok"])
    md += "\nTimes (the HTP figures are the x86 simulator's, not phone speed):\n\n"
    md += markdown_table([{"backend": b, "graph": g, **v} for b, t in report["timings"].items() for g, v in t.items()],
                         ["backend", "graph", "load_s", "passes", "pass_s_mean", "pass_s_max"])
    return md
