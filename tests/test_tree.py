"""Draft tree: scores as in paper section 3.1, trim to the budget closed under ancestors, dedup."""

import math
import random

import numpy as np
import pytest

from hyco.runtime.tree import (
    CHAIN,
    SIBLING,
    SLM,
    DraftTree,
    add_slm_children,
    plant_chain,
    sibling_score,
    trim,
)

LN = math.log(0.66)


def hybrid_tree() -> DraftTree:
    tree = DraftTree(root_token=100)
    chain = plant_chain(tree, [11, 12, 13, 14], runner_ups={1: 21, 2: 22}, rate=0.66)
    add_slm_children(tree, 0, [31, 11], [math.log(0.5), math.log(0.3)], edge_cost=LN)  # 11 duplicates y_1
    add_slm_children(tree, chain[0], [32], [math.log(0.9)], edge_cost=LN)
    add_slm_children(tree, chain[3], [33], [math.log(0.8)], edge_cost=LN)
    return tree


def test_scores_follow_section_3_1():
    tree = hybrid_tree()
    by_token = {n.token: n for n in tree.nodes}
    for depth, token in enumerate([11, 12, 13, 14], start=1):
        assert by_token[token].source == CHAIN and by_token[token].depth == depth
        assert by_token[token].score == pytest.approx(depth * LN)
    # A runner-up sibling pays the depth cost twice on its own edge: just below its chain token.
    assert by_token[21].source == SIBLING and by_token[21].parent == 0
    assert by_token[21].score == pytest.approx(2 * LN)
    assert by_token[22].parent == tree.nodes.index(by_token[11])
    assert by_token[22].score == pytest.approx(3 * LN)
    assert by_token[22].score < by_token[12].score
    # An SLM candidate adds its log-probability to the edge cost.
    assert by_token[31].source == SLM and by_token[31].score == pytest.approx(LN + math.log(0.5))
    assert by_token[32].score == pytest.approx(2 * LN + math.log(0.9))
    assert by_token[33].score == pytest.approx(5 * LN + math.log(0.8)) and by_token[33].depth == 5


def test_duplicate_child_is_not_added_twice():
    tree = hybrid_tree()
    root_children = [tree.nodes[i].token for i in tree.children(0)]
    assert sorted(root_children) == [11, 21, 31]
    assert len(tree) == 1 + 4 + 2 + 1 + 1 + 1  # root, chain, siblings, three SLM children (one deduplicated)


def test_trim_keeps_best_scores_closed_under_ancestors():
    tree = hybrid_tree()
    # Scores: y1 -0.416; sib1 and y2 -0.831; 32 -0.936; 31 -1.109; y3 and sib2 -1.247; y4 -1.662; 33 -2.30.
    small = trim(tree, 4)
    assert len(small) == 5
    assert sorted(small.tokens[1:]) == sorted([11, 21, 12, 32])
    parent_token = {n.token: tree.nodes[n.parent].token for n in tree.nodes[1:]}
    assert all(small.nodes[n.parent].token == parent_token[n.token] for n in small.nodes[1:])
    assert _closed(small)
    full = trim(tree, 32)
    assert sorted(full.tokens) == sorted(tree.tokens)


def test_trim_tie_breaks_shallower_then_earlier():
    tree = DraftTree(0)
    a = tree.add(0, 1, -1.0, SLM)
    tree.add(a, 2, -1.0, SLM)  # same score as its parent, deeper
    tree.add(0, 3, -1.0, SLM)  # same score, same depth as `a`, drafted later
    tree.add(0, 4, -1.0, SLM)
    kept = trim(tree, 2)
    assert kept.tokens == [0, 1, 3]


def test_add_rejects_a_child_scoring_above_its_parent():
    tree = DraftTree(0)
    a = tree.add(0, 1, -2.0, SLM)
    with pytest.raises(ValueError):
        tree.add(a, 2, -1.0, SLM)


@pytest.mark.parametrize("seed", range(5))
def test_trim_on_random_trees(seed):
    rng = random.Random(seed)
    tree = DraftTree(0)
    for token in range(1, 80):
        parent = rng.randrange(len(tree))
        tree.add(parent, token, tree.nodes[parent].score + LN + math.log(rng.uniform(0.01, 1.0)), SLM)
    for budget in (1, 7, 32, 200):
        kept = trim(tree, budget)
        assert len(kept) - 1 == min(budget, len(tree) - 1)
        assert _closed(kept)
        # With scores that fall along every path, the best `budget` scores are already closed.
        best = sorted((n.score for n in tree.nodes[1:]), reverse=True)[:budget]
        assert sorted((n.score for n in kept.nodes[1:]), reverse=True) == best
        for i, node in enumerate(kept.nodes[1:], start=1):
            assert node.parent < i


def test_ancestor_mask_and_wire_bytes():
    tree = hybrid_tree()
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        expect = np.zeros(len(tree), dtype=bool)
        expect[tree.path_to(i)] = True
        assert (mask[i] == expect).all()
    assert tree.wire_bytes() == 5 * len(tree)


def _closed(tree: DraftTree) -> bool:
    return all(0 <= n.parent < i for i, n in enumerate(tree.nodes) if i > 0)


def test_duplicate_draft_keeps_the_higher_score_and_its_source():
    """The issue's case: an SLM candidate at p = 0.9 that repeats the depth-1 runner-up scores
    ln r + ln 0.9, above the sibling's 2 ln r; the merged node keeps that score and the SLM as
    its source, so the trim keeps it over a weaker SLM candidate (p = 0.7). A lower-scoring
    repeat (the SLM's y_1 at p = 0.3) leaves the chain node as it was."""
    tree = DraftTree(root_token=100)
    chain = plant_chain(tree, [11, 12, 13, 14], runner_ups={1: 21}, rate=0.66)
    sibling = tree.child_with_token(0, 21)
    below = tree.add(sibling, 41, sibling_score(0.0, 0.66) + math.log(0.5), SLM)  # drafted under the sibling
    assert tree.nodes[sibling].score == pytest.approx(2 * LN)
    merged = add_slm_children(tree, 0, [21, 31, 11], [math.log(0.9), math.log(0.7), math.log(0.3)], edge_cost=LN)
    assert merged[0] == sibling and len(tree) == 1 + 4 + 1 + 1 + 1  # 21 and 11 merged, 31 new
    assert tree.nodes[sibling].score == pytest.approx(LN + math.log(0.9)) and tree.nodes[sibling].source == SLM
    # its descendant moves with it: its score was built on the sibling's
    assert tree.nodes[below].score == pytest.approx(LN + math.log(0.9) + math.log(0.5))
    assert tree.nodes[chain[0]].source == CHAIN and tree.nodes[chain[0]].score == pytest.approx(LN)
    assert tree.nodes[chain[0]].chain_depth == 1
    kept = trim(tree, 2)
    assert sorted(kept.tokens[1:]) == [11, 21]  # 31 (ln r + ln 0.7) is trimmed, not the merged 21
    assert kept.nodes[kept.child_with_token(0, 21)].source == SLM
