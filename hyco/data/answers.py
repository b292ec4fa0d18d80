"""The answers contract: the text qat trains the MTP head on and calibrate calibrates on, as the
answers stage writes it (answers/) and the stages after it read it.

A prompt is the conversation's first user turn rendered with the tokenizer's chat template and
the generation prompt, cut to its last `max_prompt_tokens` tokens (the phone never prefills
more); `corpus_answer_ids` is the conversation's own first assistant turn, teacher-forced.

Files (one stable format, read by qat and calibrate):
- `answers.jsonl`: one record per prompt, {"id", "index", "split", "source", "prompt_ids",
  "answer_ids"}, in the order of vocab/'s prompts.jsonl;
- `answers.json`: how they were made (source, sampling, lengths) and their statistics per split:
  token count, distinct tokens, the most frequent token and its share, and `degenerate` with a
  warning when the text says nothing (top share > 0.5 or fewer than 20 distinct tokens): a
  figure measured on one repeated token measures nothing.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.data.chat import EMPTY_THOUGHT

ANSWERS = "answers.jsonl"
ANSWERS_REPORT = "answers.json"
FORMAT = 1
SOURCES = ("greedy", "sampled", "corpus")
# The text is degenerate above this top-token share or below this many distinct tokens.
MAX_TOP_SHARE = 0.5
MIN_DISTINCT = 20


class DegenerateAnswersWarning(UserWarning):
    pass


def template_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _first_user(turns) -> str:
    user = next((text for role, text in turns if role == "user" and text.strip()), None)
    if user is None:
        raise HycoError("a reserved prompt conversation has no user turn")
    return user


def prompt_ids(tokenizer, turns, max_prompt_tokens: int) -> list[int]:
    """The first user turn as the model sees it at generation time, cut to the last
    `max_prompt_tokens` tokens."""
    ids = template_ids(tokenizer, [{"role": "user", "content": _first_user(turns)}], True)
    return ids[-max_prompt_tokens:]


def corpus_answer_ids(tokenizer, turns, max_new_tokens: int, eos_ids: Iterable[int] = ()) -> list[int]:
    """The first assistant turn after the first user turn, as the template renders it after the
    generation prompt; cut after the first end-of-turn id and at `max_new_tokens`. Empty when
    the conversation has no answer."""
    user = _first_user(turns)
    turns = [tuple(t) for t in turns]
    start = turns.index(("user", user))
    answer = next((text for role, text in turns[start + 1:] if role == "assistant"), None)
    if answer is None:
        return []
    messages = [{"role": "user", "content": user}]
    head = template_ids(tokenizer, messages, True)
    full = template_ids(tokenizer, messages + [{"role": "assistant", "content": answer}], False)
    shared = _common_prefix(head, full)
    # Gemma 4's generation prompt ends in an empty thought channel that a rendered past answer
    # does not carry (its template strips thoughts): the answer follows that channel.
    if shared < len(head) and tokenizer.decode(head[shared:]) != EMPTY_THOUGHT:
        raise HycoError("the chat template does not render an answer after its own generation prompt "
                        "(the corpus answers source needs prompt + answer to start with the prompt's tokens, "
                        f"up to an empty thought channel {EMPTY_THOUGHT!r})")
    ids = full[shared:]
    eos = set(eos_ids)
    ends = [k for k, t in enumerate(ids) if t in eos]
    return ids[:ends[0] + 1 if ends else len(ids)][:max_new_tokens]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def eos_ids_of(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return list(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def end_of_turn_id(tokenizer, eos_ids: set[int]) -> int:
    """The end-of-turn id the chat template writes after an answer (the last of `eos_ids` in a
    rendered exchange)."""
    ids = template_ids(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                        False)
    found = next((t for t in reversed(ids) if t in eos_ids), None)
    if found is None:
        raise HycoError(f"the chat template writes none of the end-of-turn ids {sorted(eos_ids)} after an answer")
    return found


def text_stats(token_lists: Iterable[list[int]]) -> dict[str, Any]:
    """Token count, distinct tokens, the most frequent token and its share; `degenerate` when the
    share is above MAX_TOP_SHARE or fewer than MIN_DISTINCT tokens occur."""
    counts: Counter[int] = Counter()
    n = 0
    for ids in token_lists:
        counts.update(ids)
        n += 1
    tokens = sum(counts.values())
    top, top_count = counts.most_common(1)[0] if counts else (None, 0)
    share = top_count / tokens if tokens else 0.0
    return {"answers": n, "tokens": tokens, "distinct_tokens": len(counts), "top_token": top,
            "top_share": round(share, 6), "degenerate": share > MAX_TOP_SHARE or len(counts) < MIN_DISTINCT}


def answer_stats(answers: list[dict]) -> dict[str, dict[str, Any]]:
    stats = {"all": text_stats(a["answer_ids"] for a in answers)}
    for split in sorted({a["split"] for a in answers}):
        stats[split] = text_stats(a["answer_ids"] for a in answers if a["split"] == split)
    return stats


def degenerate_warnings(stats: dict[str, dict[str, Any]], tokenizer=None) -> list[str]:
    out = []
    for split, s in stats.items():
        if split == "all" or not s["degenerate"]:
            continue
        top = repr(tokenizer.decode([s["top_token"]])) if tokenizer is not None and s["top_token"] is not None else s["top_token"]
        out.append(f"{split} answers are degenerate: {s['distinct_tokens']} distinct tokens over {s['tokens']}, "
                   f"token {top} is {s['top_share']:.0%} of them (limits: top share <= {MAX_TOP_SHARE}, "
                   f">= {MIN_DISTINCT} distinct); figures measured on them say little (answers.source)")
    return out


def write_answers(folder: Path, answers: list[dict], settings: dict[str, Any], tokenizer=None) -> dict[str, Any]:
    """Write answers.jsonl and answers.json into `folder`; warn on degenerate text; return the
    report (settings + stats + warnings)."""
    folder = Path(folder)
    with open(folder / ANSWERS, "w", encoding="utf-8") as f:
        for rec in answers:
            f.write(json.dumps(rec) + "\n")
    stats = answer_stats(answers)
    notes = degenerate_warnings(stats, tokenizer)
    for note in notes:
        warnings.warn(note, DegenerateAnswersWarning, stacklevel=2)
    report = {"format": FORMAT, **settings, "stats": stats, "warnings": notes}
    write_json(folder / ANSWERS_REPORT, report)
    return report


def read_answers(path: Path) -> list[dict]:
    """The records of an answers.jsonl; HycoError naming the file and line on anything else."""
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"answers not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
            ok = (isinstance(rec["prompt_ids"], list) and isinstance(rec["answer_ids"], list)
                  and rec["split"] in ("train", "eval") and all(isinstance(t, int) for t in rec["prompt_ids"] + rec["answer_ids"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise HycoError(f"{path}: line {n} is not an answer record {{id, split, prompt_ids, answer_ids}}")
        out.append(rec)
    if not out:
        raise HycoError(f"{path}: no answer records")
    return out
