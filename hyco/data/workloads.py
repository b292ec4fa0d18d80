"""check's workloads, read from local files (`check.workload`):

- `chat`: the chat corpus's first user turns (today's default; `inputs.load_prompts`);
- `spec-bench`: Spec-Bench's question.jsonl, one JSON object a line with `question_id`, `category`
  and `turns` (SB-480: 480 questions in 13 categories; MT-bench's 80 have two turns, and a second
  turn follows the verifier's own answer to the first in the chat);
- `infinitebench-sum`: InfiniteBench's longbook_sum_eng.jsonl, one object a line with `id`,
  `context` (a whole book) and `input` (the instruction); the verifier reads the whole prompt, the
  SLM Drafter its last `max_prompt` tokens, as on the phone.

Every line is validated; a bad one is one error naming the file and the line.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hyco.base.errors import HycoError

# check.workload.schema -> what it decodes (check --help lists this registry)
WORKLOADS = {
    "chat": "the chat corpus's first user turns (the dataset section)",
    "spec-bench": "Spec-Bench's question.jsonl (question_id, category, turns), from check.workload.source",
    "infinitebench-sum": "InfiniteBench's longbook_sum_eng.jsonl (id, context, input), from check.workload.source",
}
SCHEMAS = tuple(WORKLOADS)


@dataclass(frozen=True)
class Question:
    """One workload item: its user turns in order (a second turn is asked after the verifier's
    answer to the first). `question_id` clusters the turns in the bootstrap."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def read_workload(path: Path, schema: str) -> list[Question]:
    if schema not in ("spec-bench", "infinitebench-sum"):
        raise HycoError(f"check.workload.schema: {schema!r} is not read from a file (file schemas: spec-bench, "
                        "infinitebench-sum)")
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{path}: check.workload.source not found")
    read = _spec_bench_line if schema == "spec-bench" else _infinitebench_line
    questions, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise HycoError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict):
                raise HycoError(f"{path}:{number}: a {schema} line is a JSON object, not {type(record).__name__}")
            question = read(record, f"{path}:{number}")
            if question.question_id in seen:
                raise HycoError(f"{path}:{number}: question_id {question.question_id!r} appears twice")
            seen.add(question.question_id)
            questions.append(question)
    if not questions:
        raise HycoError(f"{path}: no {schema} questions in the file")
    return questions


@dataclass(frozen=True)
class Subset:
    """The questions check asks out of a workload file's, and how they were picked."""

    questions: list[Question]
    total: int  # questions in the file
    seed: int

    def text(self) -> str:
        """One line for check's summary, e.g. "13 of 480 questions, 1 per category across 13
        categories, seed 0"."""
        counts = Counter(q.category for q in self.questions)
        if len(self.questions) == self.total:
            return f"all {self.total} questions ({len(counts)} categories)"
        low, high = min(counts.values()), max(counts.values())
        per = f"{low}" if low == high else f"{low}-{high}"
        return (f"{len(self.questions)} of {self.total} questions, {per} per category across {len(counts)} "
                f"categories, seed {self.seed}")


def even_subset(questions: list[Question], count: int, seed: int) -> Subset:
    """`count` questions spread evenly over the categories (a workload file lists its categories in
    blocks, so its first questions would all be one kind): round-robin over the categories in the
    file's order, each category's questions in an order shuffled by `seed`. The chosen keep the
    file's order (a question's place keys its sampling seeds). All of them when `count` covers the
    file."""
    if count >= len(questions):
        return Subset(list(questions), len(questions), seed)
    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        by_category.setdefault(question.category, []).append(index)
    queues = [rng.sample(indices, len(indices)) for indices in by_category.values()]
    chosen: list[int] = []
    while len(chosen) < count:
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return Subset([questions[i] for i in sorted(chosen)], len(questions), seed)


def _spec_bench_line(record: dict, where: str) -> Question:
    missing = [k for k in ("question_id", "category", "turns") if k not in record]
    if missing:
        raise HycoError(f"{where}: spec-bench line lacks {', '.join(missing)}")
    qid, category, turns = record["question_id"], record["category"], record["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise HycoError(f"{where}: question_id must be an integer or a string, not {qid!r}")
    if not isinstance(category, str) or not category:
        raise HycoError(f"{where}: category must be a non-empty string, not {category!r}")
    if not isinstance(turns, list) or not 1 <= len(turns) <= 2 or not all(isinstance(t, str) and t.strip() for t in turns):
        raise HycoError(f"{where}: turns must be a list of one or two non-empty strings")
    return Question(str(qid), category, tuple(turns))


def _infinitebench_line(record: dict, where: str) -> Question:
    missing = [k for k in ("id", "context") if k not in record]
    if missing:
        raise HycoError(f"{where}: infinitebench-sum line lacks {', '.join(missing)}")
    context, instruction = record["context"], record.get("input") or "Summarize the book above."
    if not isinstance(context, str) or not context.strip():
        raise HycoError(f"{where}: context must be a non-empty string")
    if not isinstance(instruction, str):
        raise HycoError(f"{where}: input must be a string, not {instruction!r}")
    return Question(str(record["id"]), "infinitebench-sum", (f"{context}\n\n{instruction}",))


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The messages through the chat template, ready for the model's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
