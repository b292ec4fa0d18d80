"""The server sweep's verify pass (issue 39): transformers' StaticCache at fixed shapes, the
callable a CUDA graph captures. On the CPU: it computes the verifier's own pass (against the
check's DynamicCache tree pass), it repeats exactly after `reset()`, and it reads nothing back to
the host (what breaks a CUDA graph capture). On CUDA: the replayed graph gives the eager pass."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from hyco.runtime.inputs import load_model
from hyco.runtime.server_timing import StaticHeadChain, StaticVerifyPass
from hyco.runtime.tree_pass import CachedTreeModel

sys.path.insert(0, str(Path(__file__).parent))
from capture_check import HostCopies  # noqa: E402
from runtime_models import tiny_gemma4  # noqa: E402


@pytest.fixture(scope="module")
def models(tiny_family):
    """The tiny verifier (Gemma 4 MoE, sliding window 64, sdpa), and a Gemma 4 of another shape:
    KV-shared layers, per-layer inputs, eager attention, window 32; both fp32."""
    return {"verifier": load_model(tiny_family["verifier"], "verifier"),
            "kv-shared": tiny_gemma4(1, kv_shared=True, sliding_window=32)}


def _tokens(model, n: int, seed: int) -> list[int]:
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# contexts below the window, filling it on this pass, and beyond it (a sliding layer shifts its keys)
@pytest.mark.parametrize("name", ["verifier", "kv-shared"])
@pytest.mark.parametrize("context,rows", [(16, 5), (60, 9), (100, 17), (200, 33), (40, 1)])
def test_the_static_pass_is_the_verifiers_own_pass_and_repeats(models, name, context, rows):
    """Tolerance 1e-4 on fp32 logits of magnitude ~8 (~1e-5 relative). While the context fits
    the window both caches hold the same keys and the logits agree exactly (measured 0.0); past it
    a sliding layer's static buffer holds its window only, so attention reduces over fewer (masked)
    keys in another order: fp32 rounding, measured up to 2.4e-5."""
    model = models[name]
    context_ids, row_ids = _tokens(model, context, 1), _tokens(model, rows, 2)
    reference = CachedTreeModel(model)
    reference.prefill(context_ids)
    want = reference.forward_tree(row_ids, [-1] + list(range(rows - 1))).logits
    static = StaticVerifyPass(model, context_ids, row_ids, chunk=48)  # a chunked prefill, as at 32K
    outs = []
    for _ in range(3):
        static.reset()
        outs.append(static.run()[0].float())
    torch.testing.assert_close(outs[0], want, atol=1e-4, rtol=0)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_without_reset_a_full_window_pass_drifts(models):
    """Why reset restores the keys: past the window, a pass shifts the sliding layers' keys, so a
    second pass without reset computes something else."""
    model = models["verifier"]
    static = StaticVerifyPass(model, _tokens(model, 100, 1), _tokens(model, 9, 2))
    assert any(kv is not None for *_, kv in static.saved)
    static.reset()
    first = static.run().clone()
    for layer, length, length_int, _ in static.saved:  # the lengths back, the keys left shifted
        layer.cumulative_length.copy_(length)
        layer.cumulative_length_int = length_int
    assert not torch.equal(static.run(), first)


@pytest.mark.parametrize("context,rows", [(16, 5), (100, 17), (40, 1)])
def test_the_static_pass_could_be_captured(tiny_family, monkeypatch, context, rows):
    """The pass in BF16 (as on a GPU) on the meta device (tests/capture_check.py): prefill, MoE
    routing and transformers' masks included, nothing reads a device value back to the host and
    the timed pass copies nothing onto the device. Controls: a planted `.item()` raises there, and
    the watch sees a planted copy."""
    from hyco.runtime import server_timing

    # inputs go to the meta device (input_device reads a meta embedding as offloaded: the CPU)
    monkeypatch.setattr(server_timing, "input_device", lambda model: torch.device("meta"))
    model = load_model(tiny_family["verifier"], "verifier").to("meta", torch.bfloat16)
    static = StaticVerifyPass(model, list(range(3, 3 + context)), list(range(5, 5 + rows)))
    static.reset()
    with HostCopies() as watch:
        logits = static.run()
    assert logits.device.type == "meta" and logits.shape[:2] == (1, rows) and not watch.seen
    with pytest.raises((RuntimeError, NotImplementedError)):
        logits.sum().item()
    with HostCopies() as control:
        logits + torch.ones(logits.shape[-1]).to("meta")
    assert len(control.seen) == 1


def _handoff(verifier, context: int):
    """What the server's head starts from after the prompt: the whole prefix's K/V, e(root), h."""
    from hyco.runtime.drafters import HandoffWindow
    from hyco.runtime.verifier import ReferenceVerifier, Sampling

    window = HandoffWindow(window=None, quantize_wire=False)
    with torch.inference_mode():
        window.receive(ReferenceVerifier(verifier, Sampling(), window=None).prefill(_tokens(verifier, context, 3), None).handoff)
    return window.step_input()


@pytest.fixture(scope="module")
def head_dirs(tiny_family, tmp_path_factory):
    """The tiny assistant, and a centroid-masked copy of it (tests/ordered.py: 16 random clusters,
    top 4)."""
    from ordered import ordered_assistant

    masked = ordered_assistant(tiny_family["assistant"], tmp_path_factory.mktemp("masked") / "assistant",
                               num_centroids=16, top_k=4, fitted=False)
    return {"plain": tiny_family["assistant"], "masked": masked}


@pytest.fixture(scope="module")
def heads(head_dirs):
    return {kind: load_model(folder, "assistant") for kind, folder in head_dirs.items()}


@pytest.mark.parametrize("kind", ["plain", "masked"])
@pytest.mark.parametrize("context", [20, 100])
def test_the_head_chain_drafts_the_checks_greedy_chain(models, heads, kind, context):
    """The server's K head steps on the device give the tokens of check's own chain (`draft_chain`,
    the host's reference), a plain head and a centroid-masked one, before and past the window."""
    from hyco.npu.handoff import embed_tokens
    from hyco.runtime.mtp import draft_chain

    verifier, head = models["verifier"], heads[kind]
    start = _handoff(verifier, context)
    want = draft_chain(head, lambda ids: embed_tokens(verifier, ids), start, 4, topk=2).tokens
    got = StaticHeadChain(head, verifier, start, 4).run()
    assert got.tolist() == want.tolist() and len(set(want.tolist())) > 1


@pytest.mark.parametrize("kind", ["plain", "masked"])
def test_the_head_chain_could_be_captured(tiny_family, models, head_dirs, kind, monkeypatch):
    """The head's K steps in BF16 on the meta device, from a hand-off placed there: nothing read
    back to the host, nothing copied onto the device (tests/capture_check.py). Two reads there are
    in transformers' own step: a padding mask (check's head_step passes ones; transformers asks
    whether to skip it) and a masked head's fill (`.item()`): the chain passes no mask and fills on
    the device (`masked_logits`)."""
    from hyco.npu.handoff import StepInput
    from hyco.runtime import server_timing

    start = _handoff(models["verifier"], 40)
    monkeypatch.setattr(server_timing, "input_device", lambda model: torch.device("meta"))
    meta = lambda x: x.to("meta", torch.bfloat16)  # noqa: E731
    start = StepInput(meta(start.embed), meta(start.hidden), {t: (meta(k), meta(v)) for t, (k, v) in start.kv.items()},
                      start.position)
    verifier = load_model(tiny_family["verifier"], "verifier").to("meta", torch.bfloat16)
    head = load_model(head_dirs[kind], "assistant").to("meta", torch.bfloat16)
    chain = StaticHeadChain(head, verifier, start, 4)
    with HostCopies() as watch:
        tokens = chain.run()
    assert tokens.device.type == "meta" and tokens.shape == (4,) and not watch.seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fill_on_the_device_is_transformers_masked_logits(heads, dtype):
    """`masked_logits` against transformers' own embedder, bit for bit, on hidden states of two
    scales (the fill is the batch's scored minimum - 1, rounded once to the dtype either way)."""
    from hyco.runtime.mtp import masked_logits

    head = heads["masked"]
    embedder, weight = copy.deepcopy(head.masked_embedding).to(dtype), head.lm_head.weight.to(dtype)
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 12.0):
        hidden = (scale * torch.randn(2, 3, embedder.hidden_size, generator=g)).to(dtype)
        with torch.no_grad():
            want, got = embedder(hidden, weight), masked_logits(embedder, hidden, weight)
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a CUDA graph needs one to capture")
def test_the_replayed_graph_is_the_eager_pass(tiny_family):
    from hyco.runtime.server_timing import captured

    model = load_model(tiny_family["verifier"], "verifier").to("cuda")
    static = StaticVerifyPass(model, _tokens(model, 100, 1), _tokens(model, 17, 2))
    static.reset()
    want = static.run().clone()
    replay, output = captured(static)
    outs = []
    for _ in range(3):
        static.reset()
        replay()
        torch.cuda.synchronize()
        outs.append(output.clone())
    assert all(torch.equal(out, want) for out in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a CUDA graph needs one to capture")
@pytest.mark.parametrize("kind", ["plain", "masked"])
def test_the_replayed_head_chain_is_the_eager_chain(tiny_family, head_dirs, kind):
    from hyco.runtime.server_timing import captured

    verifier = load_model(tiny_family["verifier"], "verifier").to("cuda")
    head = load_model(head_dirs[kind], "assistant").to("cuda")
    chain = StaticHeadChain(head, verifier, _handoff(verifier, 100), 4)
    want = chain.run().clone()
    replay, output = captured(chain)
    for _ in range(3):
        replay()
        torch.cuda.synchronize()
        assert torch.equal(output, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a CUDA graph needs one to capture")
@pytest.mark.parametrize("plant_host_read", [False, True])
def test_the_cuda_sweep_replays_graphs_or_says_why_not(tiny_family, plant_host_read):
    """The sweep on CUDA: every verify shape and the head's chain captured and replayed; a model
    that reads a value back to the host during its pass (planted here) cannot be captured, and the
    sweep times it eager and says why."""
    from hyco.runtime.server_timing import Grid, measure

    model = load_model(tiny_family["verifier"], "verifier").to("cuda")
    head = load_model(tiny_family["assistant"], "assistant").to("cuda")
    if plant_host_read:
        model.get_decoder().norm.register_forward_hook(lambda module, args, out: out.sum().item())
    grid = Grid(rows=(1, 5, 33), contexts=(16, 100), prefill=(16, 64), repeats=3, warmup=1)
    times = measure(model, head, grid, vocab=model.config.get_text_config().vocab_size)
    assert all(ms > 0 for ms in [*times.verify.values(), *times.prefill.values(), times.head_step])
    if plant_host_read:
        assert times.source.startswith("CUDA events, eager (CUDA graph capture failed:")
    else:
        assert times.source == "CUDA events, CUDA graphs replayed"
