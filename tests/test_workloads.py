"""check's workloads and its bootstrap intervals: Spec-Bench and InfiniteBench files the test
writes (schemas validated line by line, a bad line one error naming file and line), and the
question-level bootstrap against cases whose interval is known in closed form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hyco.runtime_check.bootstrap import cluster_sums, paired_relative_ci, ratio_ci

from hyco.base.errors import HycoError
from hyco.data.workloads import read_workload


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


SPEC_BENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
              {"question_id": "translation_1", "category": "translation", "turns": ["Say hello in French."]},
              {"question_id": 3, "category": "math_reasoning", "turns": ["What is 2 + 3?"], "extra": 1}]


def test_spec_bench_questions_keep_ids_categories_and_both_turns(tmp_path):
    questions = read_workload(write_lines(tmp_path / "question.jsonl", SPEC_BENCH), "spec-bench")
    assert [(q.question_id, q.category, len(q.turns)) for q in questions] == [
        ("81", "writing", 2), ("translation_1", "translation", 1), ("3", "math_reasoning", 1)]
    assert questions[0].turns[1] == "Now make it rhyme."


@pytest.mark.parametrize("line,message", [
    ("{not json", r"question\.jsonl:2: not a JSON object"),
    ('["a list"]', r"question\.jsonl:2: a spec-bench line is a JSON object, not list"),
    ('{"question_id": 5, "turns": ["x"]}', r"question\.jsonl:2: spec-bench line lacks category"),
    ('{"question_id": 5, "category": "qa", "turns": []}', r"question\.jsonl:2: turns must be a list of one or two"),
    ('{"question_id": 5, "category": "qa", "turns": ["a", "b", "c"]}', r"question\.jsonl:2: turns must be"),
    ('{"question_id": 5, "category": "qa", "turns": ["  "]}', r"question\.jsonl:2: turns must be"),
    ('{"question_id": true, "category": "qa", "turns": ["x"]}', r"question\.jsonl:2: question_id must be"),
    ('{"question_id": 81, "category": "qa", "turns": ["x"]}', r"question\.jsonl:2: question_id '81' appears twice"),
])
def test_a_malformed_spec_bench_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "question.jsonl", [SPEC_BENCH[0], line])
    with pytest.raises(HycoError, match=message):
        read_workload(path, "spec-bench")


def test_infinitebench_sum_puts_the_instruction_after_the_book_and_refuses_an_empty_context(tmp_path):
    path = write_lines(tmp_path / "longbook_sum_eng.jsonl",
                       [{"id": 0, "context": "Chapter 1. It was a dark night.", "input": "Summarize the book.",
                         "answer": ["..."]}])
    (q,) = read_workload(path, "infinitebench-sum")
    assert q.category == "infinitebench-sum" and q.turns == ("Chapter 1. It was a dark night.\n\nSummarize the book.",)
    with pytest.raises(HycoError, match=r"longbook_sum_eng\.jsonl:1: context must be a non-empty string"):
        read_workload(write_lines(path, [{"id": 0, "context": ""}]), "infinitebench-sum")


def test_a_missing_or_empty_workload_file_is_refused(tmp_path):
    with pytest.raises(HycoError, match=r"nowhere\.jsonl: check\.workload\.source not found"):
        read_workload(tmp_path / "nowhere.jsonl", "spec-bench")
    with pytest.raises(HycoError, match=r"empty\.jsonl: no spec-bench questions"):
        read_workload(write_lines(tmp_path / "empty.jsonl", []), "spec-bench")


# Spec-Bench's SB-480 layout: its categories in blocks, the five of 80 questions first
SB480 = [("translation", 80), ("summarization", 80), ("qa", 80), ("math_reasoning", 80), ("rag", 80), ("writing", 10),
         ("roleplay", 10), ("reasoning", 10), ("math", 10), ("coding", 10), ("extraction", 10), ("stem", 10),
         ("humanities", 10)]


def sb480(tmp_path: Path) -> list:
    records = [{"question_id": f"{category}_{i}", "category": category, "turns": [f"{category} question {i}?"]}
               for category, n in SB480 for i in range(n)]
    return read_workload(write_lines(tmp_path / "question.jsonl", records), "spec-bench")


def test_a_subset_of_a_spec_bench_file_spans_its_categories(tmp_path):
    from hyco.data.workloads import even_subset

    questions = sb480(tmp_path)
    subset = even_subset(questions, 13, seed=0)
    assert sorted(q.category for q in subset.questions) == sorted(c for c, _ in SB480)  # one of each, not 13 writing
    assert subset.text() == "13 of 480 questions, 1 per category across 13 categories, seed 0"
    order = [questions.index(q) for q in subset.questions]
    assert order == sorted(order)  # the file's order: a question's place keys its sampling seeds
    assert even_subset(questions, 13, seed=0) == subset  # deterministic
    assert any(even_subset(questions, 13, seed=s).questions != subset.questions for s in (1, 2, 3))
    twenty = even_subset(questions, 20, seed=0)
    counts = {c: sum(q.category == c for q in twenty.questions) for c, _ in SB480}
    assert sorted(counts.values()) == [1] * 6 + [2] * 7
    assert twenty.text() == "20 of 480 questions, 1-2 per category across 13 categories, seed 0"
    everything = even_subset(questions, 480, seed=5)
    assert everything.questions == questions and everything.text() == "all 480 questions (13 categories)"


def test_a_category_with_fewer_questions_than_its_share_gives_way_to_the_others(tmp_path):
    from hyco.data.workloads import even_subset

    questions = sb480(tmp_path)[:410]  # rag (80), then writing, the only small one, cut to 10
    subset = even_subset(questions, 70, seed=0)  # 11-12 a category, but writing has 10
    counts = {c: sum(q.category == c for q in subset.questions) for c in dict.fromkeys(q.category for q in questions)}
    assert counts["writing"] == 10 and sum(counts.values()) == 70
    assert {n for c, n in counts.items() if c != "writing"} == {12}


# --- the bootstrap, against closed forms ---------------------------------------------------------


def test_turns_of_one_question_sum_into_one_cluster():
    order, sums = cluster_sums([3, 4, 5, 1], ["q1", "q2", "q1", "q3"])
    assert order == ["q1", "q2", "q3"] and sums.tolist() == [8, 4, 1]


def test_identical_questions_give_a_zero_width_interval():
    ci = ratio_ci(np.full(50, 12.0), np.full(50, 4.0))
    assert ci["value"] == 3.0 and ci["ci"] == [3.0, 3.0]


def test_two_questions_span_from_one_to_the_other():
    """Resampling two clusters: both draws the low one with probability 1/4 (> 2.5%), so the 95%
    interval runs from one cluster's MAT to the other's."""
    ci = ratio_ci(np.array([2.0, 6.0]), np.array([1.0, 1.0]))
    assert ci["value"] == 4.0 and ci["ci"] == [2.0, 6.0]


def test_many_questions_match_the_normal_interval_of_a_mean():
    """With one round per question the ratio is a mean: its 95% interval is mean +- 1.96 s / sqrt(n)
    to within the bootstrap's own noise (2,000 draws: a few percent of the width)."""
    x = np.random.default_rng(1).normal(4.0, 1.5, size=400)
    ci = ratio_ci(x, np.ones_like(x))
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert abs((ci["ci"][1] - ci["ci"][0]) / 2 - half) < 0.08 * half
    assert abs((ci["ci"][0] + ci["ci"][1]) / 2 - x.mean()) < 0.1 * half


def test_paired_difference_of_a_uniform_loss_is_exact_and_resampling_is_reproducible():
    rng = np.random.default_rng(2)
    rounds = rng.integers(20, 60, size=30).astype(float)
    committed = rounds * rng.uniform(3, 5, size=30)
    paired = paired_relative_ci(0.96 * committed, rounds, committed, rounds)
    assert paired["percent"] == pytest.approx(-4.0) and paired["ci_percent"] == pytest.approx([-4.0, -4.0])
    noisy = committed * rng.uniform(0.9, 1.0, size=30)
    one, two = paired_relative_ci(noisy, rounds, committed, rounds), paired_relative_ci(noisy, rounds, committed, rounds)
    assert one == two and one["ci_percent"][0] < one["percent"] < one["ci_percent"][1] < 0
