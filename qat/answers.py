"""The verifier's own greedy answers to the reserved prompts (the QAT training text).

The head is trained and evaluated on what the verifier itself writes (paper, appendix:
1,024 new tokens for training, 512 for evaluation), so drafting positions look like the ones
it meets at run time. A prompt is the conversation's first user turn rendered with the
tokenizer's chat template and the generation prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from hyco.errors import HycoError

ANSWERS = "answers.jsonl"


def prompt_ids(tokenizer, turns: list, max_prompt_tokens: int) -> list[int]:
    """The first user turn as the model sees it at generation time, cut to the last
    `max_prompt_tokens` tokens (the phone never prefills more)."""
    user = next((text for role, text in turns if role == "user" and text.strip()), None)
    if user is None:
        raise HycoError("a reserved prompt conversation has no user turn")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return ids[-max_prompt_tokens:]


@torch.no_grad()
def greedy_answers(verifier, tokenizer, prompts: list[dict], *, max_new_tokens: dict[str, int],
                   max_prompt_tokens: int) -> Iterator[dict]:
    """Yield {"id", "split", "prompt_ids", "answer_ids"} per prompt (greedy, stops at EOS)."""
    device = verifier.device
    for rec in tqdm(prompts, desc="qat: verifier answers", unit="prompt", disable=None):
        ids = prompt_ids(tokenizer, rec["turns"], max_prompt_tokens)
        out = verifier.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens[rec["split"]],
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
        yield {"id": rec["id"], "split": rec["split"], "prompt_ids": ids, "answer_ids": out[0, len(ids):].tolist()}


def write_answers(path: Path, answers: Iterator[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in answers:
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


def read_answers(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"answers not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
            assert isinstance(rec["prompt_ids"], list) and isinstance(rec["answer_ids"], list)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
            raise HycoError(f"{path}: line {n} is not an answer record {{id, split, prompt_ids, answer_ids}}") from None
        out.append(rec)
    return out
