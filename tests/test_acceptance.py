"""Tree verification (paper section 3.5) and the sampling distribution p~, on hand-built cases.

The distribution tests are chi-square goodness-of-fit tests at a fixed seed: the threshold is a
p-value of 1e-3 (a correct sampler fails it once in a thousand seeds; the seed is fixed, so the
test is deterministic), and the lossy epsilon rule must fail the same test on a case built for it,
which shows the test has the power to notice a wrong distribution.
"""

import math
import random

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hyco.runtime.acceptance import verify, verify_epsilon, verify_exact
from hyco.runtime.sampling import sampling_probs
from hyco.runtime.tree import SLM, DraftTree

V = 6


def tree_of(edges: list[tuple[int, int]], root_token: int = 0) -> DraftTree:
    """edges: (parent index, token), in order; scores fall with depth so `add` accepts them."""
    tree = DraftTree(root_token)
    for parent, token in edges:
        tree.add(parent, token, tree.nodes[parent].score - 1.0, SLM)
    return tree


def rows(*dists: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(len(dists), V)
    for i, d in enumerate(dists):
        for token, p in d.items():
            out[i, token] = p
    return out


# --- p~ -------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 64, 0.95), (0.7, 5, 0.8), (1.3, 0, 1.0), (1.0, 3, 0.5)])
def test_sampling_probs_match_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(7, 100) * 3
    ref = logits.clone()
    ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = torch.softmax(ref, -1)
    got = sampling_probs(logits, temperature, top_k, top_p)
    # Same float32 softmax over the same kept set; renormalisation differs by rounding only.
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sampling_probs(logits, 0.0, 64, 0.95).tolist() == [[0.0, 1.0, 0.0, 0.0]]


# --- exact verification -----------------------------------------------------------------------


def test_exact_descends_to_matching_children_and_ends_with_bonus():
    tree = tree_of([(0, 1), (0, 2), (1, 3), (3, 4), (2, 5)])
    # samples per node: root->1 (child), node1->3 (child), node3 (token 3)->2 (no child: bonus)
    verdict = verify_exact(tree, samples=[1, 3, 0, 2, 0, 0])
    assert verdict.path == [0, 1, 3]
    assert verdict.bonus == 2
    assert verdict.committed_tokens(tree) == [1, 3, 2]


def test_exact_first_sample_matching_no_child_is_bonus():
    tree = tree_of([(0, 1), (0, 2)])
    verdict = verify_exact(tree, samples=[5, 0, 0])
    assert verdict.path == [0] and verdict.bonus == 5 and verdict.accepted == 0


# --- epsilon-threshold ------------------------------------------------------------------------


def test_epsilon_takes_deepest_accepted_path():
    # root's sample 2 is a leaf child; child 1 is unsampled but p~(1) >= eps and leads deeper.
    tree = tree_of([(0, 1), (0, 2), (1, 3)])
    probs = rows({1: 0.3, 2: 0.7}, {3: 0.5, 4: 0.5}, {0: 1.0}, {5: 1.0})
    samples = [2, 4, 0, 5]
    verdict = verify_epsilon(tree, probs, samples, epsilon=0.005)
    assert verdict.path == [0, 1, 3] and verdict.bonus == 5
    assert verdict.sampled_edges == 0  # 1 was not sampled at the root, 3 not at node 1
    assert verify_exact(tree, samples).path == [0, 2]


def test_epsilon_tie_prefers_more_sampled_edges_over_higher_product():
    tree = tree_of([(0, 1), (0, 2), (1, 3), (2, 4)])
    probs = rows({1: 0.9, 2: 0.1}, {3: 1.0}, {4: 0.2, 5: 0.8}, {0: 1.0}, {0: 1.0})
    # Sample at the root is 2 (the low-probability child), at node 2 it is 4: path 0-2-4 has two
    # sampled edges against none for 0-1-3, whose p~ product (0.9) is far higher (vs 0.02).
    verdict = verify_epsilon(tree, probs, samples=[2, 3, 4, 0, 0], epsilon=0.005)
    assert verdict.path == [0, 2, 4] and verdict.sampled_edges == 2
    # With one sampled edge each, the product decides.
    verdict = verify_epsilon(tree, probs, samples=[2, 3, 5, 0, 0], epsilon=0.005)
    assert verdict.path == [0, 1, 3] and verdict.sampled_edges == 1


def test_epsilon_tie_on_product_goes_to_first_drafted():
    tree = tree_of([(0, 1), (0, 2)])
    probs = rows({1: 0.5, 2: 0.5}, {3: 1.0}, {4: 1.0})
    verdict = verify_epsilon(tree, probs, samples=[0, 3, 4], epsilon=0.005)
    assert verdict.path == [0, 1] and verdict.bonus == 3


def test_epsilon_below_threshold_is_rejected():
    tree = tree_of([(0, 1)])
    probs = rows({1: 0.004, 2: 0.996}, {0: 1.0})
    verdict = verify_epsilon(tree, probs, samples=[2, 0], epsilon=0.005)
    assert verdict.path == [0] and verdict.bonus == 2


@pytest.mark.parametrize("seed", range(20))
def test_epsilon_accepts_only_supported_tokens_and_eps1_is_exact(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree(0)
    for _ in range(25):
        parent = rng.randrange(len(tree))
        tree.add(parent, rng.randrange(V), tree.nodes[parent].score - 1.0, SLM)
    logits = torch.randn(len(tree), V, generator=gen) * 2
    probs = sampling_probs(logits, 1.0, 4, 0.9)
    samples = torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()
    verdict = verify_epsilon(tree, probs, samples, epsilon=0.05)
    for parent, child in zip(verdict.path, verdict.path[1:], strict=False):
        token = tree.nodes[child].token
        assert probs[parent, token] > 0
        assert token == samples[parent] or probs[parent, token] >= 0.05
    assert probs[verdict.path[-1], verdict.bonus] > 0
    assert verify_epsilon(tree, probs, samples, epsilon=1.0) == verify_exact(tree, samples)
    # Greedy (one-hot p~): the threshold adds nothing beyond exact verification.
    greedy = sampling_probs(logits, 0.0, 4, 0.9)
    greedy_samples = greedy.argmax(-1).tolist()
    assert verify_epsilon(tree, greedy, greedy_samples, 0.005) == verify_exact(tree, greedy_samples)


# --- distribution preservation ------------------------------------------------------------------


def chi_square_p_value(counts: dict, expected_probs: dict, n: int) -> float:
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected_probs.items() if p > 0)
    assert set(counts) <= {k for k, p in expected_probs.items() if p > 0}, "a cell with p = 0 was observed"
    dof = sum(p > 0 for p in expected_probs.values()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def committed_pair_distribution(tree: DraftTree, probs: torch.Tensor, epsilon: float, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        tokens = verify(tree, probs, epsilon, gen).committed_tokens(tree)
        key = tuple(tokens[:2]) if len(tokens) >= 2 else (tokens[0], "end")
        counts[key] = counts.get(key, 0) + 1
    return counts


def model_pair_probs(tree: DraftTree, probs: torch.Tensor) -> dict:
    """P(first two committed tokens) under the verifier alone: p~(a|root) p~(b|a) when `a` is a
    child (the round continues), else (a, end) with p~(a|root) (a is the bonus)."""
    expected = {}
    for a in range(V):
        child = tree.child_with_token(0, a)
        if child is None:
            expected[(a, "end")] = float(probs[0, a])
        else:
            for b in range(V):
                expected[(a, b)] = float(probs[0, a] * probs[child, b])
    return expected


def test_exact_verification_preserves_p_tilde():
    tree = tree_of([(0, 0), (0, 2), (0, 3), (1, 1), (2, 4)])
    probs = rows(
        {0: 0.3, 1: 0.1, 2: 0.25, 3: 0.05, 4: 0.2, 5: 0.1},
        {0: 0.1, 1: 0.5, 2: 0.4},
        {3: 0.2, 4: 0.2, 5: 0.6},
        {0: 0.7, 5: 0.3},
        {1: 1.0},
        {0: 0.5, 1: 0.5},
    )
    n = 20_000
    counts = committed_pair_distribution(tree, probs, epsilon=1.0, n=n, seed=0)
    assert chi_square_p_value(counts, model_pair_probs(tree, probs), n) > 1e-3
    first = {}
    for (a, _), c in counts.items():
        first[a] = first.get(a, 0) + c
    assert chi_square_p_value(first, {a: float(probs[0, a]) for a in range(V)}, n) > 1e-3


def test_epsilon_rule_is_lossy_and_the_test_sees_it():
    # Child 3 has p~ = 0.05 >= eps and leads deeper than the sampled leaf children, so the
    # threshold commits it far more often than p~ says.
    tree = tree_of([(0, 0), (0, 3), (2, 1)])
    probs = rows({0: 0.6, 3: 0.05, 5: 0.35}, {0: 1.0}, {1: 1.0}, {0: 1.0})
    n = 5_000
    counts = committed_pair_distribution(tree, probs, epsilon=0.005, n=n, seed=0)
    assert chi_square_p_value(counts, model_pair_probs(tree, probs), n) < 1e-6
    assert math.isclose(sum(counts.values()), n)


def test_keyed_samples_depend_only_on_the_distribution_seed_and_position():
    """The same (seed, position) draws the same token from the same row whatever the other rows of
    the call; over many positions the draws follow the row's distribution."""
    from hyco.runtime.acceptance import keyed_samples

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    alone = keyed_samples(probs[None], [17], seed=3)
    among = keyed_samples(torch.stack([probs.flip(0), probs, probs]), [4, 17, 90], seed=3)
    assert int(alone[0]) == int(among[1])
    assert not torch.equal(keyed_samples(probs.expand(64, 4), list(range(64)), seed=3),
                           keyed_samples(probs.expand(64, 4), list(range(64)), seed=4))
    draws = keyed_samples(probs.expand(4000, 4), list(range(4000)), seed=0)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
