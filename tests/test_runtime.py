"""The reference verifier's tree pass, the hand-off, the drafters and the decode loop.

Tolerances: logits are compared with transformers' own forward (no cache, causal mask) at
atol 2e-3. They are softcapped to +-30 and computed in float32 by a different summation order
(cached K/V, 4D additive masks instead of transformers' causal ones); the observed gap is
~1e-5..8e-4 on the tiny models, whose weights are scaled x3 so activations are large. Hand-off
states (embeddings, hidden states, K/V) are compared at atol 1e-4 (no softcap, smaller values).
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hyco.runtime_check.check import PhoneShapes, build_drafter
from runtime_models import tiny_gemma4  # noqa: E402

from hyco.config.recipe import CheckConfig  # noqa: E402
from hyco.data.answers import eos_ids_of
from hyco.npu.handoff import handoff_states, kv_wire_bytes  # noqa: E402
from hyco.runtime.configs import CONFIGS, decode_config  # noqa: E402
from hyco.runtime.decode import decode  # noqa: E402
from hyco.runtime.drafters import MtpChainTorch, SlmTorch, TreeDrafter  # noqa: E402
from hyco.runtime.inputs import load_model
from hyco.runtime.mtp import draft_chain
from hyco.runtime.tree_pass import FULL, SLIDING, CachedTreeModel  # noqa: E402
from hyco.runtime.verifier import ReferenceVerifier, Sampling  # noqa: E402
from hyco.runtime.wire import handoff_bytes_per_round, kv_bytes_per_token  # noqa: E402

GREEDY = Sampling(0.0, 64, 0.95)
# The paper's phone: 1,024 / 512-slot rings, 1,024 prompt tokens, a 1,024-row MTP window.
PHONE = PhoneShapes(1024, 512, 1024, 1024, "after_norm")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices on a shared 2-core machine: thread-pool spin-waits cost 10x the matmuls.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family(tiny_family):
    return {
        "verifier": load_model(tiny_family["verifier"], "verifier"),
        "assistant": load_model(tiny_family["assistant"], "assistant"),
        "slm": load_model(tiny_family["slm"], "SLM"),
    }


@pytest.fixture(scope="module")
def prompt(tiny_family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family["tokenizer"])
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea and the wind."}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"])


def path_tokens(tokens, parents, i):
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


# --- tree pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_shared", [False, True])
def test_tree_pass_matches_per_path_forward(kv_shared):
    model = tiny_gemma4(0, kv_shared=kv_shared)  # sliding window 8: the prompt crosses it
    runner = CachedTreeModel(model)
    prompt = list(range(3, 23))
    out = runner.prefill(prompt, chunk=7)
    ref = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], ref, atol=2e-3, rtol=0)
    tokens, parents = [40, 41, 42, 43, 44, 45], [-1, 0, 0, 1, 3, 2]
    out = runner.forward_tree(tokens, parents)
    for i in range(len(tokens)):
        seq = prompt + path_tokens(tokens, parents, i)
        ref = model(input_ids=torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out.logits[i], ref, atol=2e-3, rtol=0)
    runner.commit([0, 1, 3])  # root, then the accepted path 41 -> 43
    out = runner.forward_tree([50, 51], [-1, 0])
    ref = model(input_ids=torch.tensor([prompt + [40, 41, 43, 50, 51]])).logits[0, -2:]
    torch.testing.assert_close(out.logits, ref, atol=2e-3, rtol=0)


def test_ring_and_window_masks():
    runner = CachedTreeModel(tiny_gemma4(0, sliding_window=8), ring_full=5, ring_sliding=3)
    runner.prefill(list(range(3, 15)))  # 12 committed tokens at positions 0..11
    ancestor = torch.tensor([[True, False], [True, True]])
    masks = runner._masks(torch.tensor([12, 13]), ancestor)
    visible = {t: (m[0, 0] == 0) for t, m in masks.items()}
    # Rows at 12 and up never see position 7 or older again (q - k < 5): the cache drops them.
    assert runner.key_positions.tolist() == [8, 9, 10, 11]
    # Full layers, window = ring 5: row 12 sees 8..11, row 13 sees 9..11; then its tree ancestors.
    assert visible[FULL][0, :4].tolist() == [True] * 4 and visible[FULL][1, :4].tolist() == [False] + [True] * 3
    assert visible[FULL][1, 4:].tolist() == [True, True] and visible[FULL][0, 4:].tolist() == [True, False]
    # Sliding layers: window min(ring 3, model 8) = 3: row 13 sees 11 and its parent at 12.
    assert visible[SLIDING][1].tolist() == [False, False, False, True, True, True]
    wide = CachedTreeModel(tiny_gemma4(0, sliding_window=8))
    wide.prefill(list(range(3, 15)))
    masks = wide._masks(torch.tensor([12, 13]), ancestor)
    # Without rings (the verifier): full layers see everything, sliding layers q_pos - k_pos < 8
    # (transformers' rule): the row at 13 sees positions 6..11.
    assert (masks[FULL][0, 0, :, :12] == 0).all()
    assert (masks[SLIDING][0, 0, 1, :12] == 0).nonzero().flatten().tolist() == [6, 7, 8, 9, 10, 11]


def test_slm_never_prefills_more_than_max_prompt():
    slm = SlmTorch(tiny_gemma4(1, kv_shared=True), keep_ids=None, ring_full=16, ring_sliding=8, max_prompt=16)
    slm.start(list(range(3, 43)))  # 40 prompt tokens, of which the phone prefills the last 16
    assert slm.runner.key_positions.tolist() == list(range(25, 40))  # 24 can never be seen again
    assert slm.runner.committed == 40


# --- hand-off -------------------------------------------------------------------------------


def assert_handoff_matches(handoff, verifier, text, bonus, new_rows):
    """`handoff` after committing `text` (bonus sampled after it) against hyco.npu.handoff's plain pass."""
    states = handoff_states(verifier, torch.tensor(text + [bonus]), "after_norm")
    t = len(text) - 1
    assert handoff.position == t + 1
    torch.testing.assert_close(handoff.embed, states.embeds[t + 1], atol=1e-4, rtol=0)
    torch.testing.assert_close(handoff.hidden, states.hidden[t], atol=1e-4, rtol=0)
    for layer_type, (k, v) in handoff.new_kv.items():
        torch.testing.assert_close(k, states.kv[layer_type][0][:, t + 1 - new_rows:t + 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(v, states.kv[layer_type][1][:, t + 1 - new_rows:t + 1], atol=1e-4, rtol=0)


def test_handoff_matches_a_plain_verifier_pass(family, prompt):
    verifier = family["verifier"]
    cfg = decode_config("specedge", CheckConfig(temperature=0.0))
    reference = ReferenceVerifier(verifier, GREEDY)
    # The oracle SLM (the verifier itself) makes rounds accept drafts, so the K/V rows of several
    # committed tokens travel in one hand-off.
    drafter = TreeDrafter(cfg, None, SlmTorch(verifier, keep_ids=None, ring_full=1024, ring_sliding=512, max_prompt=1024))
    reply = reference.prefill(prompt, None)
    assert_handoff_matches(reply.handoff, verifier, prompt, reply.root, len(prompt))
    drafter.start(prompt, reply)
    text = prompt
    for _ in range(3):
        root = reply.root
        tree = drafter.draft(root)
        reply = reference.verify_tree(tree, cfg.epsilon, None)
        committed = [tree.nodes[i].token for i in reply.verdict.path]
        assert committed[0] == root
        drafter.commit(committed, reply)
        text = text + committed
        assert_handoff_matches(reply.handoff, verifier, text, reply.root, len(committed))
    assert reply.verdict.accepted >= 1


def test_handoff_bytes_match_the_formula(family, prompt):
    verifier = family["verifier"]
    config = verifier.config.get_text_config()
    hidden = config.hidden_size
    # Per committed token: K and V rows of the last sliding layer (kv_heads x head_dim) and of the
    # last full layer (its own kv heads and head dim), int8 plus a float16 scale per row.
    full = config.per_layer_config[config.layer_types.index("full_attention")]
    sliding = config.per_layer_config[config.layer_types.index("sliding_attention")]
    per_token = 2 * sliding.num_key_value_heads * (sliding.head_dim + 2) + 2 * full.num_key_value_heads * (full.head_dim + 2)
    assert kv_bytes_per_token({"sliding": (sliding.num_key_value_heads, sliding.head_dim),
                               "full": (full.num_key_value_heads, full.head_dim)}) == per_token
    assert handoff_bytes_per_round(hidden) == 2 * (hidden + 2)
    # The paper's sizes (26B-A4B: hidden 2816; sliding 8 x 256, full 2 x 512): 5,632 values per
    # round and 6,144 per token, i.e. 5.6 KB and 6.1 KB at 8 bits (plus our row scales).
    assert handoff_bytes_per_round(2816) == 5632 + 4
    assert kv_bytes_per_token({"sliding": (8, 256), "full": (2, 512)}) == 6144 + 2 * 2 * (8 + 2)
    cfg = decode_config("hyco", CheckConfig(temperature=0.0))
    drafter = build_drafter(cfg, CheckConfig(), PHONE, verifier=verifier, head=family["assistant"], slm=family["slm"], keep_ids=None)
    log = decode(prompt, ReferenceVerifier(verifier, GREEDY), drafter, epsilon=cfg.epsilon, max_new_tokens=8,
                 eos_ids=set(), generator=None)
    assert log.first_reply_bytes == 2 * (hidden + 2) + len(prompt) * per_token
    assert log.wire_per_round == [2 * (hidden + 2)] * len(log.rounds)
    assert log.wire_kv == [r.committed * per_token for r in log.rounds]
    assert kv_wire_bytes(1, 1, hidden) == hidden + 2


def test_mtp_drafts_from_the_live_handoff_as_from_a_plain_pass(family, prompt):
    """The chain the phone drafts from our hand-offs (float wire) equals qat/mtp.py's chain from
    hyco.npu.handoff's states over the committed text, which qat's tests tie to transformers."""
    verifier, head = family["verifier"], family["assistant"]
    reference = ReferenceVerifier(verifier, GREEDY)
    mtp = MtpChainTorch(head, verifier, keep_ids=None, window=1024, quantize_wire=False)
    reply = reference.prefill(prompt, None)
    mtp.receive(reply.handoff)
    ours = mtp.propose(4, topk=2)
    states = handoff_states(verifier, torch.tensor(prompt + [reply.root]), "after_norm")
    theirs = draft_chain(head, verifier.get_input_embeddings(), states.at(len(prompt) - 1), 4, topk=2)
    assert ours.tokens.tolist() == theirs.tokens.tolist()
    torch.testing.assert_close(ours.topk_logprobs, theirs.topk_logprobs, atol=1e-4, rtol=0)
    # Through the 8-bit wire the inputs move by at most half a quantization step per value.
    wired = MtpChainTorch(head, verifier, keep_ids=None, window=1024, quantize_wire=True)
    wired.receive(reply.handoff)
    k = reply.handoff.new_kv[FULL][0]
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((wired.kv[FULL][0] - k).abs() <= step / 2 + 1e-3 * step).all()
    assert not torch.equal(wired.kv[FULL][0], k)


def test_cloud_mtp_drafts_from_the_whole_prefix(family, prompt, monkeypatch):
    """Cloud+MTP's head runs on the server and sees every prompt row (Table 5); the phone's head
    sees the last qat.window rows. With an 8-row phone window (shorter than the prompt), the
    check gives each configuration its own window, and the server head's chain equals qat's
    chain from the hand-off over the whole prompt."""
    from hyco.runtime_check import check as check_module
    from hyco.runtime_check.check import CheckInputs, Models, decode_all, handoff_window

    verifier, head = family["verifier"], family["assistant"]
    small = PhoneShapes(1024, 512, 1024, 8, "after_norm")
    check = CheckConfig(temperature=0.0, max_new_tokens=2)
    assert len(prompt) > 8
    windows = []

    class Recording(ReferenceVerifier):
        def __init__(self, *args, window, **kwargs):
            windows.append(window)
            super().__init__(*args, window=window, **kwargs)

    monkeypatch.setattr(check_module, "ReferenceVerifier", Recording)
    for name in ("cloud-mtp", "hyco-exact"):
        decode_all([prompt], decode_config(name, check), check,
                   CheckInputs(verifier=Path(), slm=Path(), tokenizer=Path(), phone=small),
                   Models(verifier=verifier, head=head, slm=family["slm"], keep_ids=None, eos_ids=set()))
    assert windows == [None, 8]
    drafts = {}
    for name, rows in (("cloud-mtp", len(prompt)), ("hyco-exact", 8)):
        cfg = decode_config(name, check)
        drafter = build_drafter(cfg, check, small, verifier=verifier, head=head, slm=family["slm"], keep_ids=None)
        reply = ReferenceVerifier(verifier, GREEDY, window=handoff_window(cfg, small)).prefill(prompt, None)
        drafter.start(prompt, reply)
        assert [k.shape[1] for k, _ in drafter.mtp.kv.values()] == [rows, rows], name
        drafts[name] = drafter.mtp.propose(4, topk=2)
    states = handoff_states(verifier, torch.tensor(prompt + [reply.root]), "after_norm")
    whole = draft_chain(head, verifier.get_input_embeddings(), states.at(len(prompt) - 1), 4, topk=2)
    assert drafts["cloud-mtp"].tokens.tolist() == whole.tokens.tolist()
    torch.testing.assert_close(drafts["cloud-mtp"].topk_logprobs, whole.topk_logprobs, atol=1e-4, rtol=0)
    assert not torch.allclose(drafts["hyco-exact"].topk_logprobs, whole.topk_logprobs, atol=1e-4)  # 8 rows differ


# --- decode loop ----------------------------------------------------------------------------


def test_oracle_slm_gets_every_chain_token_accepted(family, prompt):
    """The verifier itself as SLM, top-1 children only: four passes draft exactly the verifier's
    greedy continuation, so every round accepts all four and commits five tokens."""
    verifier = family["verifier"]
    check = CheckConfig(temperature=0.0, slm_topk=1)
    cfg = decode_config("specedge", check)
    drafter = TreeDrafter(cfg, None, SlmTorch(verifier, keep_ids=None, ring_full=1024, ring_sliding=512, max_prompt=1024))
    log = decode(prompt, ReferenceVerifier(verifier, GREEDY), drafter, epsilon=1.0, max_new_tokens=21,
                 eos_ids=set(), generator=None)
    assert len(log.rounds) == 4
    assert [r.committed for r in log.rounds] == [5, 5, 5, 5]
    assert log.tokens == verifier.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=21,
                                           eos_token_id=None)[0, len(prompt):].tolist()


def test_sampled_decode_is_seeded_and_stays_in_support(family, prompt):
    verifier = family["verifier"]
    check = CheckConfig(temperature=1.0)
    cfg = decode_config("hyco", check)
    runs = []
    for _ in range(2):
        drafter = build_drafter(cfg, check, PHONE, verifier=verifier, head=family["assistant"], slm=family["slm"], keep_ids=None)
        runs.append(decode(prompt, ReferenceVerifier(verifier, Sampling(1.0, 64, 0.95)), drafter, epsilon=cfg.epsilon,
                           max_new_tokens=12, eos_ids=set(), generator=torch.Generator().manual_seed(3)).tokens)
    assert runs[0] == runs[1]
    greedy = verifier.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None)
    assert runs[0] != greedy[0, len(prompt):].tolist()  # temperature 1 over a random verifier: not greedy


class ScriptedDrafter:
    """Drafts the given chains, one per round, and records what the loop commits."""

    def __init__(self, chains):
        self.chains, self.commits, self.wire = list(chains), [], []
        self.bets = self.wins = 0

    def start(self, prompt, reply):
        pass

    def proactive(self, tree):
        return False

    def commit(self, tokens, reply):
        self.commits.append(tokens)

    def draft(self, root):
        from hyco.runtime.tree import SLM, DraftTree

        tree, parent = DraftTree(root), 0
        for token in self.chains.pop(0):
            parent = tree.add(parent, token, tree.nodes[parent].score - 1.0, SLM)
        return tree


class ScriptedVerifier:
    """p~ per tree row from `rows(tree)` ([len(tree), V]); verifies with the real rule."""

    def __init__(self, root, rows, vocab=16):
        self.root, self.rows, self.vocab = root, rows, vocab

    def prefill(self, prompt, generator):
        from hyco.runtime.verifier import Reply

        return Reply(self.root, None)

    def verify_tree(self, tree, epsilon, generator):
        from hyco.runtime.acceptance import verify
        from hyco.runtime.verifier import Reply

        probs = self.rows(tree)
        verdict = verify(tree, probs, epsilon, generator)
        return Reply(verdict.bonus, None, verdict, probs)


def one_hot_rows(next_token, vocab=16):
    """p~ one-hot on next_token(tree, row) at every row."""
    def rows(tree):
        return torch.nn.functional.one_hot(torch.tensor([next_token(tree, i) for i in range(len(tree))]), vocab).float()
    return rows


def follow_the_chain(bonus):
    """The verifier's sample at every row is the drafted child (all accepted), then `bonus`."""
    return one_hot_rows(lambda tree, i: tree.nodes[i + 1].token if i + 1 < len(tree) else bonus)


def test_decode_stops_at_an_eos_accepted_mid_path():
    """EOS (1) is the second of four accepted drafts: the text ends there, the round counts the two
    tokens up to the EOS (no bonus), no further round runs and no hand-off follows."""
    from hyco.runtime_check.metrics import summarize

    drafter = ScriptedDrafter([[5, 1, 7, 8], [9, 9, 9, 9]])
    log = decode([2, 3], ScriptedVerifier(3, follow_the_chain(bonus=9)), drafter, epsilon=1.0, max_new_tokens=32,
                 eos_ids={1}, generator=None)
    assert log.tokens == [3, 5, 1]
    assert len(log.rounds) == 1 and log.rounds[0].committed == 2 and log.rounds[0].bonus is None
    summary = summarize([log], None, 4)
    assert summary["mat"] == 2.0 and summary["output_tokens"] == 3 and summary["accepted_per_round"] == 2.0
    assert summary["verifier_passes_per_output_token"] == pytest.approx(2 / 3)  # prefill + one round
    assert len(drafter.chains) == 1 and drafter.commits == []  # no second round, no hand-off after the end
    # Without an EOS id the same script runs on: the whole path and the bonus are committed.
    drafter = ScriptedDrafter([[5, 1, 7, 8], [4, 4, 4, 4]])
    log = decode([2, 3], ScriptedVerifier(3, follow_the_chain(bonus=9)), drafter, epsilon=1.0, max_new_tokens=7,
                 eos_ids=set(), generator=None)
    assert log.tokens == [3, 5, 1, 7, 8, 9, 4] and [r.committed for r in log.rounds] == [5, 5]


def test_decode_stops_at_an_eos_bonus_and_counts_it():
    log = decode([2, 3], ScriptedVerifier(3, follow_the_chain(bonus=1)), ScriptedDrafter([[5, 6], [7]]), epsilon=1.0,
                 max_new_tokens=32, eos_ids={1}, generator=None)
    assert log.tokens == [3, 5, 6, 1] and [r.committed for r in log.rounds] == [3] and log.rounds[0].bonus == 1


def test_epsilon_figures_count_threshold_acceptances_and_support():
    """Row 0 puts 0.99 on 4 and 0.01 on the drafted 5: at epsilon 0.005 the threshold alone
    accepts 5 (the verifier sampled 4); row 1 samples the drafted 6, row 2 the bonus 9. So one of
    three committed tokens was not sampled, and rows hold 2, 1, 1 tokens at or above epsilon."""
    from hyco.runtime_check.metrics import summarize

    def rows(tree):
        probs = torch.zeros(len(tree), 16)
        probs[0, 4], probs[0, 5] = 0.99, 0.01
        probs[1, 6] = probs[2, 9] = 1.0
        return probs

    log = decode([2, 3], ScriptedVerifier(3, rows), ScriptedDrafter([[5, 6]]), epsilon=0.005, max_new_tokens=4,
                 eos_ids=set(), generator=torch.Generator().manual_seed(0))
    assert log.tokens == [3, 5, 6, 9]
    assert log.rounds[0].unsampled == 1 and log.rounds[0].rows_at_epsilon == 4
    summary = summarize([log], None, 4)
    assert summary["committed_unsampled_share"] == pytest.approx(1 / 3)
    assert summary["tokens_at_epsilon_per_row"] == pytest.approx(4 / 3)
    assert summary["top_probability_per_row"] == pytest.approx((0.99 + 1 + 1) / 3)
    # exact verification on the same rows rejects 5: nothing unsampled is ever committed
    exact = decode([2, 3], ScriptedVerifier(3, rows), ScriptedDrafter([[5, 6]]), epsilon=1.0, max_new_tokens=2,
                   eos_ids=set(), generator=torch.Generator().manual_seed(0), probe_epsilon=0.005)
    assert exact.tokens == [3, 4] and exact.rounds[0].unsampled == 0 and exact.rounds[0].rows_at_epsilon == 4


@torch.no_grad()
def test_exact_verification_preserves_the_verifiers_distribution_end_to_end():
    """A tiny vocabulary (8 tokens): the SLM's tree, the verifier's tree pass and exact
    verification, repeated over many seeds; the first two committed tokens follow p~ computed from
    transformers' plain forward over each path (chi-square, p > 1e-3 at a fixed seed)."""
    from test_acceptance import chi_square_p_value

    from hyco.runtime.acceptance import verify

    vocab = 8
    verifier = tiny_gemma4(0, vocab=vocab)
    slm = tiny_gemma4(7, kv_shared=True, vocab=vocab)
    sampling = Sampling(1.0, 6, 0.9)
    prompt = [3, 5, 2, 7, 4, 6, 3, 1, 5]
    check = CheckConfig(temperature=1.0, slm_topk=2, budget=6)
    drafter = TreeDrafter(decode_config("specedge", check), None,
                          SlmTorch(slm, keep_ids=None, ring_full=1024, ring_sliding=512, max_prompt=1024))
    reference = ReferenceVerifier(verifier, sampling)
    reply = reference.prefill(prompt, torch.Generator().manual_seed(0))
    drafter.start(prompt, reply)
    tree = drafter.draft(reply.root)
    probs = sampling.probs(reference.runner.forward_tree(tree.tokens, tree.parents).logits)
    expected = {}
    root_p = sampling.probs(verifier(input_ids=torch.tensor([prompt + [reply.root]])).logits[0, -1])
    for a in range(vocab):
        child = tree.child_with_token(0, a)
        if child is None:
            expected[(a, "end")] = float(root_p[a])
            continue
        child_p = sampling.probs(verifier(input_ids=torch.tensor([prompt + [reply.root, a]])).logits[0, -1])
        torch.testing.assert_close(probs[child], child_p, atol=1e-4, rtol=0)
        for b in range(vocab):
            expected[(a, b)] = float(root_p[a] * child_p[b])
    expected = {k: p for k, p in expected.items() if p > 0}
    gen = torch.Generator().manual_seed(1)
    counts, n = {}, 8000
    for _ in range(n):
        tokens = verify(tree, probs, 1.0, gen).committed_tokens(tree)
        key = (tokens[0], tokens[1]) if len(tokens) > 1 else (tokens[0], "end")
        counts[key] = counts.get(key, 0) + 1
    assert len(tree) > 3
    assert chi_square_p_value(counts, expected, n) > 1e-3



# --- the phone's graphs through onnxruntime: convert/'s SLM graphs, qat/'s MTP step graph ----------
#
# One small phone, built once for this module like the pipeline builds it: the vocab stage's keep
# set, convert's graphs over it (rings 128 / 64), and qat's drafter with tests/test_qat.py's tiny
# settings cut to 2 steps and 1 calibration sequence (a 48-row window, so the hand-off crosses it).

WINDOW = 48
GRAPH_PHONE = PhoneShapes(128, 64, 128, WINDOW, "after_norm")


@pytest.fixture(scope="module")
def phone_vocab(ladder):
    """The fast tier's ladder's vocab stage (tests/ladder.py): keep set 1,345 of the tiny tokenizer."""
    return ladder / "vocab"


@pytest.fixture(scope="module")
def keep(phone_vocab, tiny_family, family):
    from hyco.runtime_check.check import _keep_ids

    return _keep_ids(phone_vocab, tiny_family["tokenizer"], family["verifier"].config.get_text_config().vocab_size)


@pytest.fixture(scope="module")
def slm_graphs(ladder):
    """The ladder's convert stage: the tiny recipe's graphs (33 rows, prefill chunk 16, rings
    128 / 64, max prompt 128) over the ladder's keep set, parity off."""
    return ladder / "convert"


def greedy_answers(family: dict, vocab: Path, out: Path) -> Path:
    """The answers stage on `family`: the verifier's greedy answers (40 / 24 new tokens)."""
    from hyco.answers.stage import make_answers

    from hyco.config.recipe import AnswersConfig

    make_answers(verifier=family["verifier"], tokenizer=family["tokenizer"], vocab=vocab, out=out,
                 config=AnswersConfig(max_new_tokens_train=40, max_new_tokens_eval=24, max_prompt_tokens=48))
    return out


@pytest.fixture(scope="module")
def mtp_graphs(tiny_family, phone_vocab, tmp_path_factory):
    from hyco.qat.stage import build_qat

    from hyco.config.recipe import QatConfig

    out = tmp_path_factory.mktemp("qat")
    build_qat(verifier=tiny_family["verifier"], assistant=tiny_family["assistant"], tokenizer=tiny_family["tokenizer"],
              vocab=phone_vocab, answers=greedy_answers(tiny_family, phone_vocab, tmp_path_factory.mktemp("answers")),
              out=out, config=QatConfig(steps=2, lr=3e-4, warmup_steps=2, window=WINDOW, calibration_sequences=1))
    torch.set_num_threads(1)  # the qat stage may have changed it
    return out


@pytest.fixture(scope="module")
def long_prompt(tiny_family):
    """53 tokens: longer than the 48-row MTP window from the first hand-off on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family["tokenizer"])
    text = ("Write a short poem about the sea and the wind, then explain in a few sentences why sailors have "
            "always feared the storms of the northern ocean.")
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"])


@pytest.fixture(scope="module")
def srq_free_slm(tiny_family, tmp_path_factory):
    """A copy of the fixture SLM with every SRQ activation scale set to 0 (SRQ off, the QAT
    format's own convention): the same integer weights and graph structure, but no 8-bit
    activation rounding, so nothing can sit on a rounding boundary."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("srq_free") / "slm"
    shutil.copytree(tiny_family["slm"], out)
    zeroed = 0
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in tensors:
            if name.endswith("activation_scale"):
                tensors[name] = tensors[name] * 0
                zeroed += 1
        save_file(tensors, str(shard), metadata={"format": "pt"})
    assert zeroed > 0, "the fixture SLM has no SRQ scales to zero"
    return out


@pytest.fixture(scope="module")
def srq_free_graphs(srq_free_slm, tiny_family, phone_vocab, tmp_path_factory):
    from hyco.convert.stage import convert

    from hyco.config.recipe import ConvertConfig

    out = tmp_path_factory.mktemp("convert_srq_free")
    convert(checkpoint=srq_free_slm, out=out, tokenizer=tiny_family["tokenizer"],
            keep_set=phone_vocab / "keep_set.json",
            config=ConvertConfig(parity=False, prefill_chunk=16, ring_full=128, ring_sliding=64, max_prompt=128))
    return out


@pytest.mark.parametrize("prompt_ids", [range(30, 60), range(500, 563)], ids=["ids30-59", "63-tokens-past-the-window"])
def test_onnxruntime_slm_matches_the_float_slm(srq_free_slm, srq_free_graphs, keep, prompt_ids):
    """The runtime's onnxruntime SLM driver (feeds, rings, masks, commits) and its torch driver
    over transformers agree to float rounding: top-k ids equal, log-probs within 1e-4 (observed
    ~2e-6), over three rounds with committed backlogs folded into the pass. The 63-token prompt
    puts the tree's rows past the 64-token sliding window, so the ring's window rule is exercised.

    Run on the SLM with its SRQ scales zeroed: with 8-bit activation rounding on, a value within
    float error of a .5 boundary rounds differently under the two summation orders (seen: 0.05 in
    log-prob on one regenerated fixture, 9.5e-7 on the one before), and a fixed prompt cannot
    avoid that by construction. That rounding is convert's to prove, and it does: its traced
    parity (convert/parity.py, tests/test_parity.py) finds every such tie, forces it, and then
    requires 1e-4. This test is about the runtime's wiring, which SRQ does not touch."""
    from hyco.convert.load import read_checkpoint
    from hyco.convert.stage import take_quantized_here

    from hyco.runtime.slm_onnx import SlmOnnx
    from hyco.runtime.tree import SLM, DraftTree

    model = load_model(srq_free_slm, "SLM")
    # The float per_layer_model_projection with the graph's 8-bit values (as convert's parity does):
    # the wiring is under test here, not hyco-convert's quantization of that layer.
    enc = json.loads((srq_free_graphs / "encodings.json").read_text())
    assert take_quantized_here(model, read_checkpoint(srq_free_slm), enc)
    ours = SlmTorch(model, keep_ids=keep, ring_full=128, ring_sliding=64, max_prompt=1024)
    graph = SlmOnnx(srq_free_graphs, keep_ids=keep, max_prompt=1024)
    prompt = list(prompt_ids)
    ours.start(prompt)
    graph.start(prompt)
    for round_ in range(3):
        tree = DraftTree(700 + round_)
        for token in (701, 702, 703):
            tree.add(0, token, -1.0, SLM)
        tree.add(1, 704, -2.0, SLM)
        a = ours.propose(tree, list(range(len(tree))), 8)
        b = graph.propose(tree, list(range(len(tree))), 8)
        for node in a:
            assert a[node][0][:4] == b[node][0][:4]
            # compare by token id: below the top 4, near-ties may swap places between the two
            for token, logp in zip(*a[node], strict=True):
                if token in b[node][0]:
                    assert abs(logp - b[node][1][b[node][0].index(token)]) < 1e-4, (node, token)
        ours.commit([700 + round_, 701])
        graph.commit([700 + round_, 701])
    assert graph.committed == ours.runner.committed


def lut_embed(mtp_graphs, keep):
    """The phone's embedding of a drafted token (qat's 8-bit table), as an `embed_fn` for torch."""
    from hyco.npu.embed_lut import EmbedLut

    lut = EmbedLut.load(mtp_graphs / "embed_lut.safetensors")
    return lambda ids: torch.from_numpy(lut.rows(torch.searchsorted(keep, ids.reshape(-1)).numpy()))


def w4_twin(head, mtp_graphs, keep):
    """The float head with the graph's INT4 weights (head_w4.safetensors, dequantized): what 4-bit
    weight noise alone does to the chain, with float activations and unclipped inputs."""
    import copy

    from hyco.qat.step_graph import linear_names
    from safetensors.torch import load_file

    w4 = load_file(str(mtp_graphs / "head_w4.safetensors"))
    twin = copy.deepcopy(head)
    modules = dict(twin.named_modules())
    with torch.no_grad():
        for name in linear_names(len(twin.model.layers)):
            weight = w4[f"{name}.weight"].float() * w4[f"{name}.weight_scale"][:, None]
            if name == "lm_head":  # the graph's output layer holds the keep set's rows only
                modules[name].weight[keep] = weight
            else:
                modules[name].weight.copy_(weight)
    return twin


def chains_from_live_handoffs(verifier, drafters: dict, prompt, rounds: int, topk: int) -> dict[str, list]:
    """Every drafter receives the same hand-offs (8-bit wire) from the reference verifier over
    `rounds` greedy rounds of a chain-only tree (the first drafter's chain), and proposes K = 4."""
    from hyco.runtime.tree import DraftTree, plant_chain

    reference = ReferenceVerifier(verifier, GREEDY, window=WINDOW)
    reply = reference.prefill(prompt, None)
    out = {name: [] for name in drafters}
    for _ in range(rounds):
        for name, drafter in drafters.items():
            drafter.receive(reply.handoff)
            out[name].append(drafter.propose(4, topk=topk))
        tree = DraftTree(reply.root)
        plant_chain(tree, out[next(iter(drafters))][-1].tokens.tolist(), {}, 0.66)
        reply = reference.verify_tree(tree, 1.0, None)
    assert next(iter(drafters.values())).last.position > WINDOW  # the window has dropped rows
    return out


def test_float_step_graph_drafts_the_torch_chain(family, mtp_graphs, keep, long_prompt):
    """mtp_step.float.onnx driven by the onnxruntime backend equals MtpChainTorch (qat/mtp.py over
    transformers' head) token for token over 12 rounds of live hand-offs, when both embed drafted
    tokens through the same 8-bit table. Log-probs: depth 1 within 1e-4 (fp32 reordering, seen
    6e-6); depths 2-4 within 1e-3, since each step feeds back next_hidden with the previous
    step's reordering error in it (seen 1.9e-4). (With the verifier's exact embeddings instead of
    the table, the torch chain shares 85% of the tokens: this random head's margins are small.)"""
    from hyco.runtime.mtp_onnx import FLOAT_TWIN, MtpChainOnnx

    drafters = {
        "torch": MtpChainTorch(family["assistant"], family["verifier"], keep_ids=keep, window=WINDOW,
                               quantize_wire=True, embed_fn=lut_embed(mtp_graphs, keep)),
        "graph": MtpChainOnnx(mtp_graphs, keep_ids=keep, window=WINDOW, capture_point="after_norm",
                              quantize_wire=True, graph=FLOAT_TWIN),
    }
    chains = chains_from_live_handoffs(family["verifier"], drafters, long_prompt, rounds=12, topk=2)
    for ours, theirs in zip(chains["torch"], chains["graph"], strict=True):
        assert theirs.tokens.tolist() == ours.tokens.tolist()
        assert theirs.topk_ids.tolist() == ours.topk_ids.tolist()
        torch.testing.assert_close(theirs.topk_logprobs[0], ours.topk_logprobs[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(theirs.topk_logprobs, ours.topk_logprobs, atol=1e-3, rtol=0)


def test_int4_step_graph_stays_within_4bit_weight_noise(family, mtp_graphs, keep, long_prompt):
    """mtp_step.onnx (INT4 weights, uint16 input QDQ) against its float twin over 12 rounds of live
    hand-offs, at depth 1 where both see identical inputs (deeper steps feed back their own
    next_hidden and drafted token, so the chains drift apart: whole-chain top-1 share seen 0.25).

    The reference for 4-bit weight noise is `w4_twin`: the float head with the graph's own INT4
    weights. On this random tiny head top-1 margins are 0.004-0.24 nats while those weights move a
    log-prob by up to ~0.7 nats (qat's report: W4 top-1 agreement 42-50% over its evaluation
    captures, KL ~0.055), so:
    - the graph matches the W4 twin's top-8 log-probs within 0.15 (the uint16 input QDQ, which
      clips the hand-off at the captures' p99.99 ranges; seen 0.107);
    - the float graph's top-1 token moves in the quantized graph by at most what it moves in the
      W4 twin + 0.15 (seen: at most 0.071 more; the move itself reaches 0.77);
    - the quantized graph keeps the float graph's top-1 about as often as the W4 twin does (within
      2 of 12 rounds: the input QDQ may flip a near-tie). How often that is depends on the draw's
      margins, not on the graph (seen 9 of 12 on one random head, 4 of 12 on the next)."""
    from hyco.runtime.mtp_onnx import FLOAT_TWIN, MtpChainOnnx

    embed = lut_embed(mtp_graphs, keep)
    drafters = {
        "float": MtpChainOnnx(mtp_graphs, keep_ids=keep, window=WINDOW, capture_point="after_norm",
                              quantize_wire=True, graph=FLOAT_TWIN),
        "int4": MtpChainOnnx(mtp_graphs, keep_ids=keep, window=WINDOW, capture_point="after_norm", quantize_wire=True),
        "w4_twin": MtpChainTorch(w4_twin(family["assistant"], mtp_graphs, keep), family["verifier"], keep_ids=keep,
                                 window=WINDOW, quantize_wire=True, embed_fn=embed),
    }
    chains = chains_from_live_handoffs(family["verifier"], drafters, long_prompt, rounds=12, topk=8)

    def logprob_of(draft, token):
        ids = draft.topk_ids[0].tolist()
        return float(draft.topk_logprobs[0, ids.index(token)]) if token in ids else None

    kept_top1 = twin_kept_top1 = compared = 0
    for f, q, w in zip(chains["float"], chains["int4"], chains["w4_twin"], strict=True):
        for token in set(q.topk_ids[0].tolist()) & set(w.topk_ids[0].tolist()):
            assert abs(logprob_of(q, token) - logprob_of(w, token)) <= 0.15, token
        top1 = int(f.tokens[0])
        kept_top1 += int(q.tokens[0]) == top1
        twin_kept_top1 += int(w.tokens[0]) == top1
        lp_q, lp_w = logprob_of(q, top1), logprob_of(w, top1)
        if lp_q is not None and lp_w is not None:
            compared += 1
            assert abs(lp_q - float(f.topk_logprobs[0, 0])) <= abs(lp_w - float(f.topk_logprobs[0, 0])) + 0.15
    assert kept_top1 >= twin_kept_top1 - 2 and compared >= 8


def test_onnxruntime_backend_without_the_qat_graphs(slm_graphs, tmp_path):
    from hyco.runtime_check.check import CheckInputs, run_check

    from hyco.base.errors import HycoError

    inputs = CheckInputs(verifier=tmp_path, assistant=tmp_path, slm=tmp_path, tokenizer=tmp_path, phone=GRAPH_PHONE,
                         convert_dir=slm_graphs, qat_dir=tmp_path / "missing-qat")
    with pytest.raises(HycoError, match=r"needs the qat stage's graphs, but .*missing-qat/io_spec.json"):
        run_check(inputs, CheckConfig(backend="onnxruntime", drafters="float", configs=("hyco",)), tmp_path / "out")


def test_mtp_graph_refuses_settings_it_was_not_built_for(mtp_graphs, keep):
    from hyco.base.errors import HycoError
    from hyco.runtime.mtp_onnx import MtpChainOnnx

    args = {"keep_ids": keep, "window": WINDOW, "capture_point": "after_norm", "quantize_wire": True}
    with pytest.raises(HycoError, match=r"48-row K/V ring, but the check keeps 64 hand-off rows \(qat.window\)"):
        MtpChainOnnx(mtp_graphs, **{**args, "window": 64})
    with pytest.raises(HycoError, match="trained on h_t after_norm, but the verifier hands off h_t before_norm"):
        MtpChainOnnx(mtp_graphs, **{**args, "capture_point": "before_norm"})
    with pytest.raises(HycoError, match="embed_lut.safetensors: tensor 'keep_to_vocab'"):
        MtpChainOnnx(mtp_graphs, **{**args, "keep_ids": keep[:-1]})
    with pytest.raises(HycoError, match="needs that keep set"):
        MtpChainOnnx(mtp_graphs, **{**args, "keep_ids": None})


def test_slm_graph_refuses_another_ring(slm_graphs, keep):
    from hyco.base.errors import HycoError
    from hyco.runtime.slm_onnx import SlmOnnx

    with pytest.raises(HycoError, match=r"\[128\] full-attention ring slots, but the check expects convert.ring_full 64"):
        SlmOnnx(slm_graphs, keep_ids=keep, max_prompt=128, ring_full=64)


def test_slm_graph_rewound_equals_a_fresh_context(slm_graphs, keep, prompt):
    """The token bridge's rollback on the phone's graphs: forgetting the last 3 ring rows and
    running new tokens in front of the tree equals a context that never held the old ones."""
    import numpy as np

    from hyco.runtime.slm_onnx import SlmOnnx
    from hyco.runtime.tree import DraftTree

    root, tail = prompt[-1], [int(t) for t in keep[5:8]]
    rewound = SlmOnnx(slm_graphs, keep_ids=keep, max_prompt=128)
    rewound.start(prompt[:-1])
    rewound.rewind(len(prompt) - 4, tail)
    fresh = SlmOnnx(slm_graphs, keep_ids=keep, max_prompt=128)
    fresh.start(prompt[:-4])
    fresh.commit(tail)
    tree = DraftTree(root)
    got, expected = rewound.propose(tree, [0], 8)[0], fresh.propose(tree, [0], 8)[0]
    assert rewound.cached == fresh.cached == len(prompt) - 4 + len(tail)
    # Same graph, same feeds but for stale slots behind the mask: masked keys add exp(-inf) = 0.
    assert got[0] == expected[0]
    np.testing.assert_allclose(got[1], expected[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("length", [20, 70, 100], ids=["under-one-pass", "past-the-window", "three-passes-past-it"])
def test_tree_only_prefill_equals_the_chunked_prefill(slm_graphs, keep, length):
    """A tree-only SLM (no prefill graph on the phone) prefills in causal chains of the tree's 33
    rows: its K/V rings and the prompt's last row's logits equal the 16-row prefill graph's, on
    prompts under one pass, not a multiple of 33, and across the 64-slot sliding window. Same
    weights and math at other row counts: the tolerance is float32 rounding of a different
    summation order (1e-5 on rings of magnitude ~1-10; observed ~1e-6)."""
    import numpy as np

    from hyco.runtime.slm_onnx import SlmOnnx

    class Recorded(SlmOnnx):
        def _run(self, graph, tokens, parents):
            self.last = super()._run(graph, tokens, parents), len(tokens)
            return self.last[0]

    prompt = [int(t) for t in keep[np.arange(length) * 7 % len(keep)]]
    chunked = Recorded(slm_graphs, keep_ids=keep, max_prompt=128)
    tree_only = Recorded(slm_graphs, keep_ids=keep, max_prompt=128, graphs=("tree.onnx", None))
    assert chunked.prefill_graph == "prefill" and tree_only.prefill_graph == "tree" and "prefill" not in tree_only.specs
    passes = []
    for slm in (chunked, tree_only):
        calls = []
        run = slm.run
        slm.run = lambda graph, feeds, names=None, calls=calls, run=run: calls.append(graph) or run(graph, feeds, names)
        slm.start(prompt)
        passes.append(calls)
    assert passes == [["prefill"] * -(-length // 16), ["tree"] * -(-length // 33)]
    assert chunked.cached == tree_only.cached == length
    for layer in chunked.ring.k:
        np.testing.assert_allclose(tree_only.ring.k[layer], chunked.ring.k[layer], atol=1e-5, rtol=0)
        np.testing.assert_allclose(tree_only.ring.v[layer], chunked.ring.v[layer], atol=1e-5, rtol=0)
    (a, rows_a), (b, rows_b) = chunked.last, tree_only.last
    np.testing.assert_allclose(b["logits"][rows_b - 1], a["logits"][rows_a - 1], atol=1e-4, rtol=0)
    for kind, slots in chunked.ring.slot_positions.items():
        assert np.array_equal(tree_only.ring.slot_positions[kind], slots), kind


# --- greedy losslessness where drafts are accepted: the distilled family -------------------------
#
# On the undistilled family no draft is ever accepted, so "exact greedy decoding equals the
# verifier's own generate" would hold for any drafter. The distilled family's drafters agree with
# its verifier, so these runs accept drafts (asserted) and the equality is evidence. They hold no
# MAT figure of the fixture: only that drafts were accepted at all.

EXACT = [name for name in CONFIGS if decode_config(name, CheckConfig()).epsilon >= 1]


@pytest.fixture(scope="module")
def distilled(tiny_family_distilled):
    return {name: load_model(tiny_family_distilled[name], what)
            for name, what in (("verifier", "verifier"), ("assistant", "assistant"), ("slm", "SLM"))}


@pytest.fixture(scope="module")
def distilled_prompts(tiny_family_distilled, long_prompt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family_distilled["tokenizer"])
    ids = tok.apply_chat_template([{"role": "user", "content": "What are some good ways to learn a new language?"}],
                                  add_generation_prompt=True, tokenize=True)
    return [long_prompt, list(ids["input_ids"])]


@pytest.fixture(scope="module")
def distilled_keep(phone_vocab, tiny_family, tiny_family_distilled, distilled):
    """The vocab stage's keep set (built on the same tokenizer) for the distilled graphs."""
    from hyco.runtime_check.check import _keep_ids

    assert (tiny_family_distilled["tokenizer"] / "tokenizer.json").read_bytes() == \
        (tiny_family["tokenizer"] / "tokenizer.json").read_bytes()
    return _keep_ids(phone_vocab, tiny_family_distilled["tokenizer"],
                     distilled["verifier"].config.get_text_config().vocab_size)


def assert_greedy_lossless(verifier, drafters, prompts, cfg, window, max_new=24) -> int:
    """Greedy decoding with exact verification commits the verifier's own greedy `generate`
    output on every prompt; returns the number of accepted draft tokens."""
    accepted = 0
    for prompt, drafter in zip(prompts, drafters, strict=True):
        log = decode(prompt, ReferenceVerifier(verifier, GREEDY, window=window), drafter, epsilon=cfg.epsilon,
                     max_new_tokens=max_new, eos_ids=set(eos_ids_of(verifier)), generator=torch.Generator().manual_seed(0))
        expected = verifier.generate(torch.tensor([prompt]), do_sample=False,
                                     max_new_tokens=max_new)[0, len(prompt):].tolist()
        assert log.tokens == expected, cfg.name
        assert all(r.tree_nodes <= cfg.budget for r in log.rounds)
        accepted += sum(len(r.accepted_sources) for r in log.rounds)
    return accepted


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EXACT, "hyco"])
def test_greedy_decode_equals_verifier_generate(distilled, distilled_prompts, distilled_keep, name):
    """Float drafters (torch) over the vocab stage's keep set: the output is the verifier's own,
    and drafts were accepted, so the equality says something. Every exact configuration, and
    HyCo's epsilon rule too (greedy p~ is one-hot: the threshold accepts only the verifier's token)."""
    from hyco.runtime_check.check import handoff_window

    check = CheckConfig(temperature=0.0)
    cfg = decode_config(name, check)
    drafters = [build_drafter(cfg, check, PHONE, verifier=distilled["verifier"], head=distilled["assistant"],
                              slm=distilled["slm"], keep_ids=distilled_keep) for _ in distilled_prompts]
    accepted = assert_greedy_lossless(distilled["verifier"], drafters, distilled_prompts, cfg,
                                      handoff_window(cfg, PHONE))
    assert accepted > 0, name


@pytest.fixture(scope="module")
def distilled_graphs(tiny_family_distilled, phone_vocab, tmp_path_factory):
    """convert's SLM graphs and qat's step graph built from the distilled family, with the
    settings of `slm_graphs` and `mtp_graphs`."""
    from hyco.convert.stage import convert
    from hyco.qat.stage import build_qat

    from hyco.config.recipe import ConvertConfig, QatConfig

    family = tiny_family_distilled
    slm_out, qat_out = tmp_path_factory.mktemp("convert-distilled"), tmp_path_factory.mktemp("qat-distilled")
    convert(checkpoint=family["slm"], out=slm_out, tokenizer=family["tokenizer"], keep_set=phone_vocab / "keep_set.json",
            config=ConvertConfig(parity=False, prefill_chunk=16, ring_full=128, ring_sliding=64, max_prompt=128))
    build_qat(verifier=family["verifier"], assistant=family["assistant"], tokenizer=family["tokenizer"],
              vocab=phone_vocab, answers=greedy_answers(family, phone_vocab, tmp_path_factory.mktemp("answers-distilled")),
              out=qat_out, config=QatConfig(steps=2, lr=3e-4, warmup_steps=2, window=WINDOW, calibration_sequences=1))
    torch.set_num_threads(1)  # the qat stage may have changed it
    return {"convert": slm_out, "qat": qat_out}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*EXACT, "hyco-2p"])
def test_greedy_decode_on_onnxruntime_accepts_drafts_and_equals_generate(distilled, distilled_graphs, distilled_keep,
                                                                          distilled_prompts, name):
    """`check.backend: onnxruntime`: the SLM Drafter on convert/'s graphs and the phone's MTP
    Drafter on qat/'s INT4 mtp_step.onnx (Cloud+MTP's head stays float on the server), all from
    the distilled family. Exact verification under greedy sampling commits the verifier's own
    greedy `generate` output, and the graphs' drafts were accepted. (hyco-2p too: greedy p~ is
    one-hot, so its epsilon rule accepts only the verifier's own token.)"""
    from hyco.runtime_check.check import handoff_window

    from hyco.runtime.mtp_onnx import MtpChainOnnx
    from hyco.runtime.slm_onnx import SlmOnnx

    check = CheckConfig(temperature=0.0, backend="onnxruntime", drafters="float")
    cfg = decode_config(name, check)
    drafters = [build_drafter(cfg, check, GRAPH_PHONE, verifier=distilled["verifier"], head=distilled["assistant"],
                              slm=None, keep_ids=distilled_keep, convert_dir=distilled_graphs["convert"],
                              qat_dir=distilled_graphs["qat"]) for _ in distilled_prompts]
    d = drafters[0]
    assert isinstance(d.slm, SlmOnnx) == bool(cfg.slm_passes)
    assert isinstance(d.mtp, MtpChainOnnx) == (bool(cfg.mtp_depth) and not cfg.mtp_on_server)
    accepted = assert_greedy_lossless(distilled["verifier"], drafters, distilled_prompts, cfg,
                                      handoff_window(cfg, GRAPH_PHONE))
    assert accepted > 0, name


@torch.no_grad()
def step_by_step(model, prompt: list[int], keep: torch.Tensor, topk: int, sampling: Sampling, seed: int,
                 max_new_tokens: int, eos: set[int]) -> list[int]:
    """The SLM's own decoding through transformers' forward and cache: each token from its
    top-`topk` log-probs over `keep`, through p~, keyed by its position (`slm-alone`'s rule)."""
    from transformers import DynamicCache

    from hyco.runtime.acceptance import keyed_samples

    cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
    while len(out) < max_new_tokens and (not out or out[-1] not in eos):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1, keep]
        logprobs, index = torch.log_softmax(logits.float(), -1).topk(topk)
        pick = keyed_samples(sampling.probs(logprobs[None]), [len(prompt) + len(out)], seed)[0]
        out.append(int(keep[index[pick]]))
        ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_slm_alone_is_the_slms_own_decoding(temperature):
    """`slm-alone` (the SLM Drafter decoding by itself, one pass a token) against an independent
    loop over transformers' own forward and cache: the same tokens, greedy and sampled, with a
    keep set and a prompt that crosses the sliding window. Every round commits one token, and
    no verifier pass is counted."""
    from hyco.runtime_check.metrics import summarize

    from hyco.runtime.decode import decode_alone

    model = tiny_gemma4(5, kv_shared=True)
    keep = torch.tensor(sorted(set(range(3, 96, 2)) | {1}))
    prompt = [2] + [int(t) for t in torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(1))]
    sampling = Sampling(temperature, 64, 0.95)
    cfg = decode_config("slm-alone", CheckConfig())
    assert cfg.alone and cfg.slm_passes == 1
    for seed in (3, 4):
        slm = SlmTorch(model, keep_ids=keep, ring_full=1024, ring_sliding=512, max_prompt=1024)
        log = decode_alone(prompt, slm, topk=cfg.slm_topk, sampling=sampling, seed=seed, max_new_tokens=24, eos_ids={1})
        want = step_by_step(model, prompt, keep, cfg.slm_topk, sampling, seed, 24, {1})
        assert log.tokens == want and len(set(want)) > 4, (log.tokens, want)  # more than one repeated token
        figures = summarize([log], keep.numpy(), 0)
        assert figures["mat"] == 1.0 and figures["rounds"] == len(want) and figures["verifier_passes_per_output_token"] == 0
    if temperature:  # the keyed samples matter: another seed, another text
        other = decode_alone(prompt, SlmTorch(model, keep_ids=keep, ring_full=1024, ring_sliding=512, max_prompt=1024),
                             topk=cfg.slm_topk, sampling=sampling, seed=9, max_new_tokens=24, eos_ids={1})
        assert other.tokens != want


class ContextFreeSlm:
    """An SLM whose children of token t are 2t+1 (log-prob -0.1 - 0.001 t) and 2t+2 (-2.0 - 0.002 t),
    whatever came before: trees small enough to write out by hand."""

    def __init__(self):
        self.passes, self.committed = 0, []

    def start(self, prompt):
        pass

    def commit(self, tokens):
        self.committed += tokens

    def propose(self, tree, nodes, topk):
        self.passes += 1
        return {n: ([2 * tree.tokens[n] + 1, 2 * tree.tokens[n] + 2][:topk],
                    [-0.1 - 0.001 * tree.tokens[n], -2.0 - 0.002 * tree.tokens[n]][:topk]) for n in nodes}


def test_proactive_drafting_starts_the_next_tree_from_a_won_bet_by_hand():
    """specedge-pd on a hand-built case (1 pass a round, 2 proactive passes, budget 6, top-2).
    Round 1 drafts 1 -> {3, 4}. The bet is the best path 1-3: pass one grows 3 -> {7, 8}, pass two
    grows 7 -> {15, 16} and 8 -> {17, 18}; the trim to 6 drops 18, and the last pass's best new
    nodes are 15 (-0.21) and 17 (-2.11, above 16's -2.12). Won (1-3 accepted, bonus 7): the next
    tree starts from {7: 15, 16} and its pass grows the frontier under 7, 15 -> {31, 32}: depth 2
    where SpecEdge-style has depth 1. Lost (another path, or a bonus the bet did not draft): the
    next tree is drafted afresh."""
    from hyco.runtime.verifier import Reply

    cfg = replace(decode_config("specedge-pd", CheckConfig()), slm_passes=1, pd_passes=2, budget=6, slm_topk=2)
    assert cfg.epsilon == 1.0 and decode_config("specedge-pd", CheckConfig(pd_passes=3)).pd_passes == 3

    def round_one():
        drafter = TreeDrafter(cfg, None, ContextFreeSlm())
        tree = drafter.draft(1)
        assert (tree.tokens, tree.parents) == ([1, 3, 4], [-1, 0, 0])
        drafter.proactive(tree)
        assert drafter.slm.passes == 3 and drafter.bets == 1
        _, bet, leaf, frontier = drafter.bet
        assert (bet.tokens, bet.parents) == ([1, 3, 7, 8, 15, 16, 17], [-1, 0, 1, 1, 2, 2, 3])
        assert bet.tokens[leaf] == 3 and [bet.tokens[i] for i in frontier] == [15, 17]
        return drafter

    won = round_one()
    won.commit([1, 3], Reply(7, None))
    tree = won.draft(7)
    assert won.wins == 1 and (tree.tokens, tree.parents) == ([7, 15, 16, 31, 32], [-1, 0, 0, 1, 1])
    assert tree.nodes[3].score == pytest.approx((-0.1 - 0.007) + (-0.1 - 0.015))  # relative to the new root
    assert won.slm.committed == [1, 3]  # the bet's tokens never entered the SLM's context
    for tokens, bonus in (([1, 4], 9), ([1, 3], 99)):  # another path; the bet's path with an undrafted bonus
        lost = round_one()
        lost.commit(tokens, Reply(bonus, None))
        tree = lost.draft(bonus)
        assert lost.wins == 0 and (tree.tokens, tree.parents) == ([bonus, 2 * bonus + 1, 2 * bonus + 2], [-1, 0, 0])
