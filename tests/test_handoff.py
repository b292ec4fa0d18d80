"""The hand-off and the float MTP chain against transformers' own MTP drafting."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hyco.qat.mtp import TeacherForcedHead, teacher_forced_inputs
from hyco.qat.tiny_models import SLIDING_WINDOW, VOCAB, tiny_assistant, tiny_verifier
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from hyco.base.errors import HycoError
from hyco.npu.handoff import (
    attention_masks,
    dequantize_kv_rows,
    embed_tokens,
    handoff_states,
    kv_wire_bytes,
    quantize_kv_rows,
)
from hyco.runtime.mtp import draft_chain, head_step


@pytest.fixture(scope="module")
def models():
    return tiny_verifier(), tiny_assistant()


def _prompt(n, seed=0):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_capture_points_match_transformers_hidden_states(models):
    verifier, _ = models
    ids = _prompt(20)
    ref = verifier(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    after = handoff_states(verifier, ids, "after_norm")
    before = handoff_states(verifier, ids, "before_norm")
    torch.testing.assert_close(after.hidden, ref.hidden_states[-1][0], rtol=0, atol=0)
    torch.testing.assert_close(verifier.model.norm(before.hidden[None])[0], after.hidden, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(before.hidden, after.hidden)
    for name, (k, v) in ref.shared_kv_states.items():
        torch.testing.assert_close(after.kv[name][0], k[0], rtol=0, atol=0)
        torch.testing.assert_close(after.kv[name][1], v[0], rtol=0, atol=0)
    # e(x) is the *scaled* embedding the assistant consumes
    scale = math.sqrt(verifier.config.hidden_size)
    torch.testing.assert_close(after.embeds, verifier.model.embed_tokens.weight[ids[0]] * scale)
    with pytest.raises(HycoError, match="capture_point"):
        handoff_states(verifier, ids, "middle")


def test_chain_matches_candidate_generator_after_prefill(models):
    """A prompt three times the sliding window, so the head's sliding mask matters."""
    verifier, head = models
    prompt = _prompt(3 * SLIDING_WINDOW, seed=1)
    out = verifier(prompt, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    ids = torch.cat([prompt, first], dim=1)
    gen = SinglePositionMultiTokenCandidateGenerator(head, verifier.get_input_embeddings(), verifier.generation_config)
    gen.main_model_max_length = 1000
    cand, cand_logits = gen.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out,
                                           is_first_iteration=False, n_last_matches=0)
    states = handoff_states(verifier, ids)
    draft = draft_chain(head, lambda t: embed_tokens(verifier, t), states.at(prompt.shape[1] - 1), depth=4)
    assert draft.tokens.tolist() == cand[0, ids.shape[1]:].tolist()
    ref_lp = torch.log_softmax(cand_logits[0].float(), -1)
    torch.testing.assert_close(draft.topk_logprobs[:, 0], ref_lp.max(-1).values, rtol=1e-5, atol=1e-5)


def test_chain_matches_assisted_generation_round_by_round(models):
    """Every draft of transformers' assisted generation is reproduced from our hand-off over
    the sequence that round's verifier pass processed. After a rejection transformers keeps the
    rejected candidate's K/V row at t+1 (it slices to the new length), so kv_len follows it;
    where no stale row exists, the hand-off over the final text gives the same draft."""
    verifier, head = models
    prompt = _prompt(5, seed=2)
    rounds = []
    orig = SinglePositionMultiTokenCandidateGenerator.get_candidates

    def record(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        cand, logits = orig(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)
        if logits is not None:
            kv_rows = model_outputs.shared_kv_states["full_attention"][0].shape[2]
            rounds.append((input_ids.clone(), cand.clone(), min(kv_rows, input_ids.shape[1])))
        return cand, logits

    SinglePositionMultiTokenCandidateGenerator.get_candidates = record
    try:
        out = verifier.generate(prompt, assistant_model=head, max_new_tokens=SLIDING_WINDOW - 5, do_sample=False)
    finally:
        SinglePositionMultiTokenCandidateGenerator.get_candidates = orig
    assert out.shape[1] <= SLIDING_WINDOW  # K/V rows are positions: no sliding-cache trimming
    assert len(rounds) >= 2
    final = handoff_states(verifier, out[0])
    embed = lambda x: embed_tokens(verifier, x)
    stale_rounds = 0
    for i, (input_ids, cand, kv_rows) in enumerate(rounds):
        t = input_ids.shape[1] - 2
        candidates = cand[0, input_ids.shape[1]:]
        processed = input_ids[0] if i == 0 else rounds[i - 1][1][0]  # what the verifier ran over
        # the verified token x_{t+1} (the bonus token) replaces the rejected candidate there
        start = replace(handoff_states(verifier, processed).at(t, kv_len=kv_rows),
                        embed=embed(input_ids[0, -1:])[0])
        draft = draft_chain(head, embed, start, depth=len(candidates))
        assert draft.tokens.tolist() == candidates.tolist(), f"round {i}"
        if kv_rows == t + 1:
            assert draft_chain(head, embed, final.at(t), depth=len(candidates)).tokens.tolist() == candidates.tolist()
        else:
            stale_rounds += 1
    assert stale_rounds < len(rounds)  # at least one round checked the plain hand-off


def test_teacher_forced_head_matches_step_by_step(models):
    """All drafting positions at once (masks from `attention_masks`) equal one HF call per
    position (transformers' own masks), across the sliding window."""
    verifier, head = models
    states = handoff_states(verifier, _prompt(3 * SLIDING_WINDOW, seed=3))
    student = TeacherForcedHead(head)
    inputs = teacher_forced_inputs(states.embeds, states.hidden, states.kv, head.config.text_config.sliding_window)
    with torch.no_grad():
        logits, nxt = student(*inputs)
    for t in range(states.input_ids.shape[0] - 1):
        s = states.at(t)
        ref_logits, ref_next = head_step(head, s.embed, s.hidden, s.kv, s.position)
        torch.testing.assert_close(logits[0, t], ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(nxt[0, t], ref_next, rtol=1e-4, atol=1e-4)


def test_masks():
    full, sliding = attention_masks(np.array([0, 1, 2, 3, -1]), np.array([1, 4]), sliding_window=1)
    assert (full == 0).tolist() == [[True, False, False, False, False], [True, True, True, True, False]]
    assert (sliding == 0).tolist() == [[True, False, False, False, False], [False, False, True, True, False]]


def test_wire_quantization_roundtrip():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 7, 16)).astype(np.float32) * rng.uniform(0.1, 10, size=(2, 7, 1)).astype(np.float32)
    q, scale = quantize_kv_rows(x)
    assert q.dtype == np.int8 and scale.shape == (2, 7, 1) and scale.dtype == np.float16
    err = np.abs(dequantize_kv_rows(q, scale) - x)
    assert (err <= scale.astype(np.float32) * 0.5 + 1e-6).all()  # half a step per row
    assert q.nbytes + scale.nbytes == kv_wire_bytes(2, 7, 16)


def test_past_the_sliding_window_the_handoff_carries_committed_rows_only(models):
    """Intended behaviour (hyco/runtime/verifier.py): every round hands the head the K/V rows of
    the committed tokens only, at their own positions, and the head's sliding window is applied by
    position; so past the window our live hand-off and chain equal `handoff_states` over the
    committed text (what qat/ trains on). transformers' candidate generator does otherwise there:
    it hands the head its verifier's sliding cache, which past the window holds the last rows of
    the sequence the verifier processed, rejected candidates included; that is shown here too."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    from hyco.config.recipe import CheckConfig
    from hyco.runtime.configs import decode_config
    from hyco.runtime.decode import decode
    from hyco.runtime.drafters import MtpChainTorch, TreeDrafter
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    verifier, head = models
    prompt = _prompt(5, seed=2)
    # transformers: record the sliding K/V each round hands the head, and what the verifier ran over.
    passed = []
    orig = SinglePositionMultiTokenCandidateGenerator.get_candidates

    def record(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        cand, logits = orig(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)
        if logits is not None:
            k = model_outputs.shared_kv_states["sliding_attention"][0][0, :, :input_ids.shape[1]]
            passed.append((input_ids.shape[1], k.clone(), cand[0].clone()))
        return cand, logits

    SinglePositionMultiTokenCandidateGenerator.get_candidates = record
    try:
        verifier.generate(prompt, assistant_model=head, max_new_tokens=SLIDING_WINDOW + 16, do_sample=False)
    finally:
        SinglePositionMultiTokenCandidateGenerator.get_candidates = orig
    past = [(n, k, prev[2]) for (n, k, _), prev in zip(passed[1:], passed, strict=False) if n > SLIDING_WINDOW + 4]
    assert len(past) >= 8
    for n, k, processed in past:
        # The rows handed over are the last rows of what the verifier just ran (the previous
        # round's candidates), reaching past the n committed tokens: rejected candidates' rows.
        ran = handoff_states(verifier, processed).kv["sliding_attention"][0]
        assert k.shape[1] < n and len(processed) > n
        torch.testing.assert_close(k, ran[:, len(processed) - k.shape[1]:], atol=1e-4, rtol=0)

    # Ours: a chain-only tree drafted by the head from the live hand-off, greedy, past the window.
    cfg = decode_config("cloud-mtp", CheckConfig(temperature=0.0))
    mtp = MtpChainTorch(head, verifier, keep_ids=None, window=None, quantize_wire=False)
    chains = []
    propose = mtp.propose
    mtp.propose = lambda depth, topk: chains.append((mtp.last.position, dict(mtp.kv), propose(depth, topk))) or chains[-1][2]
    log = decode(prompt[0].tolist(), ReferenceVerifier(verifier, Sampling(0.0, 64, 0.95), window=None),
                 TreeDrafter(cfg, mtp, None), epsilon=1.0, max_new_tokens=SLIDING_WINDOW + 16, eos_ids=set(),
                 generator=None)
    final = handoff_states(verifier, torch.tensor(prompt[0].tolist() + log.tokens))
    embed = lambda x: embed_tokens(verifier, x)
    late = [c for c in chains if c[0] > SLIDING_WINDOW + 4]
    assert len(late) >= 8
    for position, kv, draft in chains:
        t = position - 1
        for layer_type, (k, v) in kv.items():  # exactly the committed positions 0..t
            torch.testing.assert_close(k, final.kv[layer_type][0][:, :t + 1], atol=1e-4, rtol=0)
            torch.testing.assert_close(v, final.kv[layer_type][1][:, :t + 1], atol=1e-4, rtol=0)
        assert draft.tokens.tolist() == draft_chain(head, embed, final.at(t), depth=4).tokens.tolist(), position
