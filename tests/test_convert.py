"""convert/: graph surgery of the E2B QAT fixture into static integer ONNX graphs.

One conversion of the tiny fixture (with a keep set and parity) is shared by the module; the
rewrites, host pieces and bad inputs are tested on their own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from hyco.config.recipe import ConvertConfig
from hyco.npu import host
from hyco.pipeline.cli import main

KEEP_SIZE = 3000


def write_keep_set(folder: Path, tokenizer_dir: Path, ids) -> Path:
    from hyco.base.files import write_json
    from hyco.data.keepset import (
        KEEP_SET,
        KEEP_TO_VOCAB,
        VOCAB_TO_KEEP,
        index_maps,
        load_tokenizer,
        tokenizer_hash,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_dir)
    ids = sorted(int(i) for i in ids)
    keep_to_vocab, vocab_to_keep = index_maps(np.asarray(ids), len(tok))
    write_json(folder / KEEP_SET, {"size": len(ids), "tokenizer": tokenizer_hash(tok), "vocab_size": len(tok),
                                   "token_ids": ids})
    np.save(folder / KEEP_TO_VOCAB, keep_to_vocab)
    np.save(folder / VOCAB_TO_KEEP, vocab_to_keep)
    return folder / KEEP_SET


@pytest.fixture(scope="module")
def converted(tiny_family, tmp_path_factory):
    from hyco.convert.stage import convert

    root = tmp_path_factory.mktemp("convert")
    ids = np.random.default_rng(0).choice(4096, KEEP_SIZE, replace=False)
    keep = write_keep_set(root / "vocab", tiny_family["tokenizer"], ids)
    out = root / "out"
    config = ConvertConfig(rows=33, prefill_chunk=16, ring_full=128, ring_sliding=64, topk=8, parity_ring_full=32)
    summary = convert(checkpoint=tiny_family["slm"], out=out, config=config, keep_set=keep,
                      tokenizer=tiny_family["tokenizer"])
    return {"out": out, "summary": summary, "keep": np.asarray(sorted(ids)), "config": config,
            "checkpoint": tiny_family["slm"]}


def test_outputs_written(converted):
    out = converted["out"]
    for name in ("tree.onnx", "tree.onnx.data", "prefill.onnx", "prefill.onnx.data", "rope.json", "io_spec.json",
                 "encodings.json", "bitexact.json", "parity.json", "report.json", "summary.md",
                 "luts/embed_tokens.safetensors", "luts/embed_tokens_per_layer.safetensors"):
        assert (out / name).is_file(), name
    for graph in ("tree.onnx", "prefill.onnx"):
        onnx.checker.check_model(str(out / graph), full_check=True)
        model = onnx.load(str(out / graph), load_external_data=False)
        assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {21}


def test_bitexact_all_true_with_every_bit_width(converted):
    report = json.loads((converted["out"] / "bitexact.json").read_text())
    assert report["all_equal"] is True
    rows = report["graphs"]["tree.onnx"]
    assert all(r["ints_equal"] and r["scales_equal"] for r in rows.values())
    assert {r["bits"] for r in rows.values()} == {2, 4, 8}
    for r in rows.values():  # int2 travels in INT4 containers, never INT2; 8 bits as INT8
        assert r["container"] == ("INT8" if r["bits"] == 8 else "INT4")
    assert rows["lm_head"]["shape"][0] == KEEP_SIZE
    enc = json.loads((converted["out"] / "encodings.json").read_text())
    assert any(e["srq_input_scale"] > 0 for e in enc["weights"].values())
    assert len(enc["kv_cache_scales"]) == 14  # k and v of all 7 layers (published: the shared ones too)


def test_prefill_weights_proven_byte_for_byte_against_tree(converted, tmp_path):
    """prefill.onnx's ints and scales are proven equal to tree.onnx's (proven against the
    checkpoint) by bytes; one flipped bit in one prefill weight, or in one scale, fails that row."""
    import shutil

    from hyco.convert.stage import same_weights

    report = json.loads((converted["out"] / "bitexact.json").read_text())
    tree, prefill = report["graphs"]["tree.onnx"], report["graphs"]["prefill.onnx"]
    assert prefill.keys() == tree.keys()
    assert all(r["proof"] == "bytes equal tree.onnx's" and r["ints_equal"] and r["scales_equal"] for r in prefill.values())
    out = tmp_path / "out"
    shutil.copytree(converted["out"], out)
    enc = json.loads((out / "encodings.json").read_text())
    model = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    (ints_of, e), (scale_of, e2) = sorted(enc["weights"].items())[:2]

    def flip(name: str, at: int, mask: int) -> None:
        t = inits[name]
        if t.data_location != onnx.TensorProto.EXTERNAL:  # small tensors live in the graph itself
            raw = bytearray(t.raw_data)
            raw[at] ^= mask
            t.raw_data = bytes(raw)
            return
        info = {x.key: x.value for x in t.external_data}
        assert info["location"] == "prefill.onnx.data", "the test flips a byte of prefill.onnx's own data file"
        with open(out / info["location"], "r+b") as f:
            f.seek(int(info.get("offset", 0)) + at)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ mask]))

    flip(e["onnx_initializer"], 3, 0x10)
    flip(e2["onnx_initializer"][:-len("ints")] + "scale", 0, 0x01)  # the lowest mantissa bit of one scale
    onnx.save(model, str(out / "prefill.onnx"))  # the weights stay where they are
    rows = same_weights(out, "prefill.onnx", "tree.onnx", enc, tree)
    assert not rows[ints_of]["ints_equal"] and rows[ints_of]["scales_equal"]
    assert rows[scale_of]["ints_equal"] and not rows[scale_of]["scales_equal"]
    assert all(r["ints_equal"] and r["scales_equal"] for k, r in rows.items() if k not in (ints_of, scale_of))


def test_no_weight_folded_to_float(converted):
    model = onnx.load(str(converted["out"] / "tree.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    dq_weights = [n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(dq_weights) == len(json.loads((converted["out"] / "encodings.json").read_text())["weights"])
    for name in dq_weights:
        assert inits[name].data_type in (onnx.TensorProto.INT4, onnx.TensorProto.INT8)
    # Float initializers are norm weights, scales and small constants: none is a matrix.
    floats = [t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2]
    assert floats == []


def test_parity_against_transformers(converted):
    """The traced rule (convert/parity.py) on the undistilled fixture, default rings (128 / 64)
    and rings shrunk to 32 / 16: every differing SRQ code was a rounding tie, and with the
    ties forced every logit is within 1e-4 and the argmax agrees everywhere."""
    from test_parity import assert_traced_parity

    parity = assert_traced_parity(converted["out"])
    checks = parity["checks"]
    assert checks["prefill_chain"]["decoded"] > 0 and checks["prefill_chain"]["positions"] >= 20
    assert checks["tree"]["nodes"] == 33 and checks["tree"]["branching_nodes"] > 0
    ring = checks["past_ring"]
    assert ring["context"] > 2 * 32 and ring["positions"] == ring["context"]
    # A prompt longer than the ring: only its last ring_full tokens, at absolute positions
    window = checks["prompt_past_the_ring"]
    assert window["prompt"] > 2 * 32 and window["prefilled"] == 32
    assert window["start_position"] == window["prompt"] - 32
    assert window["decoded"] > 0 and window["positions"] == 32 + window["decoded"]
    assert window["windows"]["sliding_attention"] == 16
    summary = json.loads((converted["out"] / "report.json").read_text())
    assert summary["parity_passed"] is True and summary["proof_failed"] is None


def _edit_initializer(folder: Path, graph: str, name: str, edit) -> None:
    """Rewrite one initializer of a written graph (external data rewritten beside it)."""
    from onnx import numpy_helper

    model = onnx.load(str(folder / graph))
    t = next(t for t in model.graph.initializer if t.name == name)
    t.CopyFrom(numpy_helper.from_array(edit(numpy_helper.to_array(t).copy()), name))
    (folder / (graph + ".data")).unlink()
    onnx.save_model(model, str(folder / graph), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=graph + ".data", size_threshold=1024)


def _parity_of(out: Path, tiny_family, keep, only: tuple[str, ...]) -> dict:
    from hyco.convert.load import read_checkpoint
    from hyco.convert.stage import run_parity

    from hyco.npu.host import Rope

    return run_parity(read_checkpoint(tiny_family["slm"]), keep, out, None, Rope.from_json(out / "rope.json"),
                      only=only)


def _swap_rows(a):
    a[[0, 1]] = a[[1, 0]]
    return a


@pytest.mark.parametrize("mutation,check", [
    ("srq_scale", "prefill_chain"), ("mask_entry", "tree"), ("ring_key_position", "prefill_chain"),
    ("weight_scale_swap", "tree")])
def test_traced_parity_catches_mutations(mutation, check, converted, tiny_family, tmp_path, monkeypatch):
    """Each wrong graph or host step fails the traced rule with a message naming the check.
    The same check (same tokens: the draws do not depend on `only`) passes on the unmutated
    graphs in test_parity_against_transformers, so the failure is the mutation's."""
    out = tmp_path / "out"
    shutil.copytree(converted["out"], out)
    if mutation == "srq_scale":  # one SRQ scale 1% off in the graphs
        for graph in ("tree.onnx", "prefill.onnx"):
            _edit_initializer(out, graph, "layers.1.attn.o_proj.srq_out", lambda a: a * np.float32(1.01))
    elif mutation == "weight_scale_swap":  # a per-channel weight scale swapped between two rows
        for graph in ("tree.onnx", "prefill.onnx"):
            _edit_initializer(out, graph, "layers.2.mlp.gate_proj.scale", _swap_rows)
    elif mutation == "mask_entry":  # one mask entry of one tree row flipped (row 20 no longer sees the root)
        masks = host.KVRing.masks

        def flipped(self, positions, ancestors, active=None):
            m = masks(self, positions, ancestors, active)
            if self.rows == 33 and active is not None and active[20]:
                slots = m["mask_full"].shape[1] - 33
                assert m["mask_full"][20, slots] == 0
                m["mask_full"][20, slots] = self.mask_negative
            return m

        monkeypatch.setattr(host.KVRing, "masks", flipped)
    else:  # the key of one ring slot rotated at the wrong position (position 5 stored as if at 6)
        write, rope = host.KVRing.write, host.Rope.from_json(out / "rope.json")

        def misrotated(self, outputs, rows, positions):
            write(self, outputs, rows, positions)
            layer = self.layers[0]
            if 5 in list(positions):
                cos, sin = rope.tables(layer.layer_type, [1])
                k = self.k[layer.layer][:, 5 % layer.slots]
                half = k.shape[-1] // 2
                self.k[layer.layer][:, 5 % layer.slots] = k * cos + np.concatenate([-k[:, half:], k[:, :half]], -1) * sin

        monkeypatch.setattr(host.KVRing, "write", misrotated)
    parity = _parity_of(out, tiny_family, converted["keep"], (check,))
    assert not parity["passed"] and parity["failure"].startswith(f"{check}: "), parity["failure"]
    kinds = ("not a rounding tie", "before the first differing SRQ code", "SRQ inputs differ", "logits differ")
    assert any(k in parity["failure"] for k in kinds), parity["failure"]


def test_traced_parity_requires_every_srq_rounding_of_transformers(converted, tiny_family, monkeypatch):
    """A rounding transformers makes that the graph lacks fails the proof before any check."""
    from hyco.convert import parity

    found = parity.reference_srq_points
    monkeypatch.setattr(parity, "reference_srq_points",
                        lambda model, ids: found(model, ids) | {("model.layers.2.mlp.up_proj", "output")})
    result = _parity_of(converted["out"], tiny_family, converted["keep"], ("tree",))
    assert not result["passed"] and list(result["checks"]) == ["srq_points"]
    assert result["failure"] == ("srq_points: the graph lacks 1 SRQ rounding(s) transformers makes "
                                 "(first: model.layers.2.mlp.up_proj output)")


def test_prompt_window_keeps_last_tokens_at_absolute_positions():
    ids, start = host.prompt_window(np.arange(100, 140), 32)
    assert start == 8 and ids.tolist() == list(range(108, 140))
    ids, start = host.prompt_window([5, 6, 7], 32)  # a short prompt is kept whole, from 0
    assert start == 0 and ids.tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        host.prompt_window([1], 0)


def test_io_spec_and_rings(converted):
    from hyco.npu.io_spec import read_io_spec

    specs = read_io_spec(converted["out"] / "io_spec.json")
    tree, prefill = specs["tree.onnx"], specs["prefill.onnx"]
    assert tree.meta["rows"] == 33 and prefill.meta["rows"] == 16
    # max_prompt follows the ring actually built: min(convert.max_prompt = 1024, ring_full = 128)
    assert converted["config"].max_prompt == 1024 and tree.meta["max_prompt"] == prefill.meta["max_prompt"] == 128
    assert tree.input("mask_full").shape == (33, 128 + 33)
    assert tree.input("mask_sliding").shape == (33, 64 + 33)
    assert tree.output("topk_indices").shape == (33, 8) and tree.output("logits").shape == (33, KEEP_SIZE)
    # KV-shared layers 4-6 read the rings of layers 2 (sliding) and 3 (full): only 0-3 own rings
    assert [r["layer"] for r in tree.meta["rings"]] == [0, 1, 2, 3]
    assert tree.meta["kv_owner"] == {"0": 0, "1": 1, "2": 2, "3": 3, "4": 2, "5": 2, "6": 3}


def test_luts_bit_exact_to_transformers(converted, tiny_family):
    from hyco.convert.load import load_model, read_checkpoint

    model, text, _ = load_model(read_checkpoint(tiny_family["slm"]))
    ids = np.arange(4096)
    with torch.no_grad():
        tokens = text.embed_tokens(torch.from_numpy(ids)).numpy()
        per_layer = text.embed_tokens_per_layer(torch.from_numpy(ids)).numpy()
    lut = host.EmbeddingLut.open(converted["out"] / "luts/embed_tokens.safetensors")
    ple = host.EmbeddingLut.open(converted["out"] / "luts/embed_tokens_per_layer.safetensors")
    assert (lut.bits, ple.bits) == (2, 4)  # the published bit map
    assert lut.scale.shape == (4096, 1) and ple.scale.shape == (4096, 7)  # one scale per layer's block
    assert np.array_equal(lut.lookup(ids).view(np.uint32), tokens.view(np.uint32))
    assert np.array_equal(ple.lookup(ids).view(np.uint32), per_layer.view(np.uint32))


@pytest.mark.parametrize("bits,blocks", [(2, 1), (4, 4), (8, 2)])
def test_lut_lookup_matches_quantized_embedding(bits, blocks, tmp_path):
    """Any bit width, block-wise scales and a non-power-of-two embed_scale (E2B's sqrt(1536))."""
    from safetensors.numpy import save_file
    from transformers.integrations.gemma_quant import QuantizedEmbedding

    from hyco.formats.gemma_quant import pack

    torch.manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    ints = torch.randint(lo, hi + 1, (50, 24), dtype=torch.int8)
    scale = torch.rand(50, blocks) * 0.1
    emb = QuantizedEmbedding(50, 24, torch.float32, embed_scale=1536**0.5, num_bits=bits)
    emb.embedding_quantized.data = pack(ints, bits)
    emb.embedding_scale.data = scale
    path = tmp_path / "t.safetensors"
    save_file({"packed": pack(ints, bits).numpy(), "scale": scale.numpy()}, str(path),
              metadata={"bits": str(bits), "dim": "24", "embed_scale": repr(1536**0.5)})
    ids = np.array([0, 7, 49, 7])
    got = host.EmbeddingLut.open(path).lookup(ids)
    want = emb(torch.from_numpy(ids)).detach().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --- named rewrites, each alone ---------------------------------------------------------------


def test_integer_linear_equals_quantized_linear():
    from hyco.convert.rewrites import integer_linear
    from transformers.integrations.gemma_quant import QuantizedLinear

    from hyco.formats.gemma_quant import pack

    torch.manual_seed(0)
    for bits in (2, 4, 8):
        q = QuantizedLinear(20, 12, num_bits=bits)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q.weight.data = pack(torch.randint(lo, hi + 1, (12, 20), dtype=torch.int8), bits)
        q.weight_scale.data = torch.rand(12, 1)
        q.input_activation_scale.data = torch.tensor(0.02)
        q.output_activation_scale.data = torch.tensor(0.05)
        x = torch.randn(5, 20)
        assert torch.equal(integer_linear(q, "t")(x), q(x))


def test_int_initializer_from_packed_bytes_equals_unpacked_ints():
    """export_onnx builds each INT4/INT8 initializer from the checkpoint's packed bytes (XOR,
    a 256-entry int2 table, or unpack + pack for rows that do not line up): the same values
    as transformers' unpacking, for every width and row length."""
    from hyco.convert.export_onnx import int_tensor
    from hyco.convert.rewrites import integer_linear
    from onnx import numpy_helper
    from transformers.integrations.gemma_quant import QuantizedLinear

    from hyco.formats.gemma_quant import pack
    from hyco.formats.int4 import pack_int4, unpack_int4

    torch.manual_seed(0)
    for bits in (2, 4, 8):
        for width in (20, 18, 19, 1):
            q = QuantizedLinear(width, 7, num_bits=bits)
            lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
            values = torch.randint(lo, hi + 1, (7, width), dtype=torch.int8)
            q.weight.data = pack(values, bits)
            m = integer_linear(q, "t")
            assert m.packed.data_ptr() == q.weight.data_ptr()  # the checkpoint's tensor, not a copy
            t = int_tensor("t.ints", m)
            assert list(t.dims) == [7, width]
            if bits <= 4:
                assert t.raw_data == pack_int4(values.numpy()), (bits, width)
                got = unpack_int4(t.raw_data, 7 * width).reshape(7, width)
            else:
                got = numpy_helper.to_array(t)
            assert np.array_equal(got, values.numpy()), (bits, width)


def test_int2_pair_lookup_equals_the_byte_table_on_every_pair_of_bytes():
    """int2 weights go to INT4 two bytes per lookup (`int2_to_int4_bytes`): on all 65,536 pairs
    of bytes, and on an odd tail, the same bytes as the one-byte table that the test above
    holds to transformers' unpacking."""
    from hyco.convert.export_onnx import INT2_TO_INT4, int2_to_int4_bytes

    every_pair = np.arange(65536, dtype="<u2").view(np.uint8)
    assert int2_to_int4_bytes(every_pair) == INT2_TO_INT4[every_pair].tobytes()
    odd = every_pair[:7].reshape(7, 1)
    assert int2_to_int4_bytes(odd) == INT2_TO_INT4[odd].tobytes()


def test_rmsnorm_decomposed_close_to_transformers():
    from hyco.convert.rewrites import decompose_rmsnorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    torch.manual_seed(0)
    norm = Gemma4RMSNorm(32, eps=1e-6)
    norm.weight.data = torch.randn(32)
    x = torch.randn(7, 32) * 3
    # pow(ms, -0.5) vs 1/sqrt(ms): at most a float32 ulp or two apart
    torch.testing.assert_close(decompose_rmsnorm(norm)(x), norm(x), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_sliced_topk_past_65536_on_onnxruntime(tmp_path):
    """The HTP returns TopK indices modulo 65,536: no TopK in the graph may search a wider
    input, yet the result must be the exact top-k over 70,000 entries."""
    from hyco.convert.static_model import SlicedTopK

    from hyco.qnn.ort import ort_session

    torch.manual_seed(0)
    x = torch.randn(3, 70_000)
    x[0, 69_999] = 50.0  # the best entry sits past 65,535
    path = tmp_path / "topk.onnx"
    torch.onnx.export(SlicedTopK(8), (x,), str(path), dynamo=False, opset_version=20, input_names=["x"],
                      output_names=["values", "indices"])
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}
    shapes["x"] = [3, 70_000]
    topk_inputs = [n.input[0] for n in model.graph.node if n.op_type == "TopK"]
    assert len(topk_inputs) == 3 and all(shapes[i][-1] <= 65_536 for i in topk_inputs)
    values, indices = ort_session(path).run(None, {"x": x.numpy()})
    want_v, want_i = torch.topk(x, 8)
    assert np.array_equal(values, want_v.numpy()) and np.array_equal(indices, want_i.numpy())
    assert indices[0, 0] == 69_999


@pytest.mark.parametrize("graph", ["tree.onnx", "prefill.onnx"])
def test_htp_legal_graph(converted, graph):
    """Both shipped SLM graphs obey the HTP rules (tests/htp_rules.py; qat's step graph too)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from htp_rules import htp_violations

    assert htp_violations(converted["out"] / graph) == []


def test_host_masks_follow_transformers_window_rule():
    """Row at position p sees key s iff s <= p and p - s < window (transformers'
    sliding_window_overlay: kv > q - window), for ring entries and new rows alike."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    layers = [host.RingLayer(0, "sliding_attention", 1, 4, 8), host.RingLayer(1, "full_attention", 1, 4, 12)]
    ring = host.KVRing(layers, {"sliding_attention": 5, "full_attention": 12}, rows=4, mask_negative=-50.0)
    outputs = {f"new_{kv}_{i}": np.zeros((1, 4, 4), np.float32) for kv in "kv" for i in (0, 1)}
    for start in (0, 4, 8):  # positions 0..11 committed in three passes; the 8-slot ring wraps
        ring.write(outputs, np.arange(4), np.arange(start, start + 4))
    positions = np.arange(12, 16)
    masks = ring.masks(positions, host.chain_ancestors(4))
    assert set(np.unique(masks["mask_sliding"])) == {0.0, -50.0}
    for name, layer_type, window in (("mask_sliding", "sliding_attention", 5), ("mask_full", "full_attention", 12)):
        rule = sliding_window_causal_mask_function(window)
        keys = np.concatenate([ring.slot_positions[layer_type], positions])
        for r, p in enumerate(positions):
            for c, s in enumerate(keys):
                want = bool(s >= 0 and rule(0, 0, torch.tensor(int(p)), torch.tensor(int(s))))
                assert (masks[name][r, c] == 0) == want, (name, p, s)


def test_tree_ancestors_and_positions():
    parents = [-1, 0, 0, 1, 1, 2]
    anc = host.tree_ancestors(parents)
    assert anc[3].tolist() == [True, True, False, True, False, False]
    assert anc[5].tolist() == [True, False, True, False, False, True]
    assert host.tree_positions(parents, 10).tolist() == [10, 11, 11, 12, 12, 12]
    with pytest.raises(ValueError):
        host.tree_ancestors([-1, 2, 0])


def test_rope_tables_match_transformers(converted, tiny_family):
    from transformers import AutoConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_family["slm"]).get_text_config()
    rotary = Gemma4TextRotaryEmbedding(config)
    rope = host.Rope.from_json(converted["out"] / "rope.json")
    positions = np.array([0, 1, 5, 63, 64, 1000, 100_000])
    for layer_type in ("sliding_attention", "full_attention"):
        cos, sin = rotary(torch.zeros(1), torch.from_numpy(positions)[None], layer_type)
        c, s = rope.tables(layer_type, positions)
        np.testing.assert_allclose(c, cos[0].numpy(), atol=2e-6)  # float32 cos/sin of identical angles
        np.testing.assert_allclose(s, sin[0].numpy(), atol=2e-6)
    # proportional RoPE: 3/4 of the full layers' frequencies are zero (cos 1, sin 0)
    full = rope.inv_freq["full_attention"]
    assert (full == 0).sum() == len(full) * 3 // 4


# --- layouts and bad input -----------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path, rename=None, drop=(), add=None, config_edit=None) -> Path:
    """A copy of a sharded checkpoint with tensors renamed, dropped or added."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    weight_map = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        tensors = {(rename(k) if rename else k): v for k, v in load_file(str(shard)).items() if k not in drop}
        if add and shard.name.startswith("model-00001"):
            tensors.update(add)
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config = config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, dst / f.name)
    return dst


def to_multimodal(config: dict) -> dict:
    from transformers import Gemma4Config

    quant = config.pop("quantization_config")
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    mm = Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=False).to_dict()
    mm["architectures"] = ["Gemma4ForConditionalGeneration"]
    mm["quantization_config"] = quant
    return mm


def test_multimodal_layout_gives_the_same_graph(tiny_text_family, tmp_path):
    """A text-only checkpoint moved into the multimodal wrapper (names under model.language_model.,
    a tower tensor, an unused k_proj) converts to the same graph."""
    from hyco.convert.stage import convert

    from hyco.qnn.ort import ort_session

    src = tiny_text_family["slm"]
    extra = {"model.language_model.layers.5.self_attn.k_proj.weight": torch.zeros(16, 32, dtype=torch.int8),
             "model.vision_tower.patch_embedder.weight": torch.zeros(4, 4)}
    mm = copy_checkpoint(src, tmp_path / "mm", rename=lambda k: k.replace("model.", "model.language_model.", 1),
                         add=extra, config_edit=to_multimodal)
    out = tmp_path / "out"
    # topk_slice 1000 < 4096 vocabulary: the in-graph top-k searches 5 slices, as 86,089 needs 2
    config = ConvertConfig(rows=4, prefill_chunk=4, ring_full=16, ring_sliding=8, topk=8, parity=False,
                           use_keep_set=False, topk_slice=1000)
    convert(checkpoint=mm, out=out, config=config)
    convert(checkpoint=src, out=tmp_path / "text", config=config)
    report = json.loads((out / "report.json").read_text())
    assert report["layout"] == "multimodal" and report["bitexact_all_equal"]
    assert report["load"]["extra"] == []
    assert report["load"]["unused_shared_kv"] == ["model.language_model.layers.5.self_attn.k_proj.weight"]
    assert report["load"]["ignored_towers"] == 1
    # Same feeds through the text-only conversion's graph and this one
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in onnx.load(str(out / "tree.onnx"), load_external_data=False).graph.input}
    a, logprobs, indices = ort_session(out / "tree.onnx").run(["logits", "topk_logprobs", "topk_indices"], feeds)
    b = ort_session(tmp_path / "text" / "tree.onnx").run(["logits"], feeds)[0]
    np.testing.assert_array_equal(a, b)
    graph_ops = [n.op_type for n in onnx.load(str(out / "tree.onnx"), load_external_data=False).graph.node]
    assert graph_ops.count("TopK") == 5 + 1  # 5 slices of <= 1000, then one over the 40 candidates
    # sliced top-k = the exact top-k of the log-softmax over the whole row
    assert np.array_equal(indices, np.argsort(-a, axis=-1, kind="stable")[:, :8])
    want = torch.log_softmax(torch.from_numpy(a), -1).numpy()
    np.testing.assert_allclose(logprobs, np.take_along_axis(want, indices, -1), atol=1e-5)


def _convert_cli(checkpoint: Path, out: Path, *extra: str) -> int:
    return main(["convert", "--checkpoint", str(checkpoint), "--out", str(out), "--no-parity",
                 "--rows", "4", "--prefill-chunk", "4", "--ring-full", "16", "--ring-sliding", "8", *extra])


def _quant_edit(**changes):
    def edit(config):
        config["quantization_config"].update(changes)
        return config
    return edit


@pytest.mark.parametrize("case,expect", [
    ("quant_method", "quant_method must be 'gemma'"),
    ("bits", "must be one of [2, 4, 8], but got 3"),
    ("missing", "missing tensor model.layers.1.mlp.up_proj.weight_scale"),
    ("misshapen", "misshapen tensor model.layers.0.self_attn.q_proj.weight"),
    ("truncated", "truncated"),
])
def test_bad_checkpoint_exits_2_without_output(case, expect, tiny_text_family, tmp_path, capsys):
    src = tiny_text_family["slm"]
    if case == "quant_method":
        ck = copy_checkpoint(src, tmp_path / "ck", config_edit=_quant_edit(quant_method="awq"))
    elif case == "bits":
        ck = copy_checkpoint(src, tmp_path / "ck", config_edit=lambda c: (
            c["quantization_config"]["module_quant_configs"].update({r"\.o_proj$": {"num_bits": 3}}) or c))
    elif case == "missing":
        ck = copy_checkpoint(src, tmp_path / "ck", drop=("model.layers.1.mlp.up_proj.weight_scale",))
    elif case == "misshapen":
        ck = copy_checkpoint(src, tmp_path / "ck", drop=("model.layers.0.self_attn.q_proj.weight",),
                             add={"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 7, dtype=torch.uint8)})
    else:
        ck = copy_checkpoint(src, tmp_path / "ck")
        shard = sorted(ck.glob("model-*.safetensors"))[2]
        shard.write_bytes(shard.read_bytes()[:-100])
    out = tmp_path / "out"
    assert _convert_cli(ck, out) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_architectures_null_loads_from_model_type(tiny_text_family, tmp_path):
    """transformers loads a config whose "architectures" is null (from model_type); so does convert."""
    from hyco.convert.stage import convert

    def no_architectures(config):
        assert config["model_type"] == "gemma4_text"
        return config | {"architectures": None}

    ck = copy_checkpoint(tiny_text_family["slm"], tmp_path / "ck", config_edit=no_architectures)
    config = ConvertConfig(rows=4, prefill_chunk=4, ring_full=16, ring_sliding=8, topk=4, parity=False,
                           use_keep_set=False)
    convert(checkpoint=ck, out=tmp_path / "out", config=config)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["layout"] == "text-only" and report["bitexact_all_equal"]


def test_keep_set_from_another_tokenizer_exits_2(tiny_family, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel({f"w{i}": i for i in range(4096)} | {"[UNK]": 4096}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=other).save_pretrained(tmp_path / "other_tok")
    keep = write_keep_set(tmp_path / "vocab", tmp_path / "other_tok", range(0, 4096, 2))
    out = tmp_path / "out"
    assert _convert_cli(tiny_family["slm"], out, "--keep-set", str(keep)) == 2
    err = capsys.readouterr().err
    assert "keep set was built for another tokenizer" in err and "keep_set.json" in err
    assert not out.exists()


@pytest.mark.slow  # by its measured duration (pytest --durations)
def test_parity_exact_without_srq_rounding(tiny_text_family, tmp_path):
    """Justifies the tolerance policy: with the checkpoint's SRQ scales zeroed (rounding off),
    every position of every check is within 1e-4 of transformers, so the few larger
    differences of the real checkpoint are SRQ rounding flips, not a semantic difference."""
    from hyco.convert.stage import convert
    from safetensors.torch import load_file

    src = tiny_text_family["slm"]
    srq = {k: torch.tensor(0.0) for shard in src.glob("model-*.safetensors") for k in load_file(str(shard))
           if k.endswith("activation_scale")}
    ck = copy_checkpoint(src, tmp_path / "ck", drop=tuple(srq), add=srq)
    config = ConvertConfig(rows=9, prefill_chunk=8, ring_full=64, ring_sliding=64, topk=4, parity_ring_full=16,
                           use_keep_set=False)
    convert(checkpoint=ck, out=tmp_path / "out", config=config)
    checks = json.loads((tmp_path / "out" / "parity.json").read_text())["checks"]
    for name, c in checks.items():
        assert c["max_abs_diff"] < 1e-4 and c["positions_over_tolerance"] == 0, (name, c["max_abs_diff"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_export_holds_no_second_copy_of_the_weights(tiny_text_family, tmp_path, monkeypatch):
    """Large models: while the graphs are traced and written, the module's PACKED ints (the
    checkpoint's own storage tensors, no int8 copy) are the only full copy of the weights
    (bench/bench_convert.py measures the peak, tests/test_convert_memory.py bounds it):
    tracing makes no float weight (the traced DequantizeLinear value owns less storage than
    even the packed ints), the exporter serializes no weight (they are data-free graph inputs),
    and `finalize` writes each tensor's bytes to external data before making the next, and
    writes exactly the module's ints and scales."""
    from hyco.convert import export_onnx, static_model
    from hyco.convert.load import load_model, read_checkpoint
    from hyco.convert.rewrites import build_static_model
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor

    from hyco.formats.int4 import unpack_int4

    ckpt = read_checkpoint(tiny_text_family["slm"])
    model, text, lm_head = load_model(ckpt)
    settings = ConvertConfig(ring_full=32, ring_sliding=16, topk=4, mask_negative=-50.0, float_linear_bits=None)
    static = build_static_model(text, lm_head, settings, text_prefix=ckpt.layout.text_prefix, keep_ids=None)
    del model, text, lm_head
    linears = export_onnx.int_linears(static)
    params = static.state_dict()
    for m in linears.values():  # packed at the checkpoint's width; the buffer is a 1-byte stand-in
        assert m.packed.numel() == m.shape[0] * -(-m.shape[1] * m.bits // 8), m.source
        assert m.ints.untyped_storage().nbytes() <= 1

    traced = []  # (weight shape, bytes of storage behind the traced linear's output)
    int_matmul = static_model._IntMatMul.forward

    def spy_int_matmul(ctx, x, ints, scale):
        y = int_matmul(ctx, x, ints, scale)
        traced.append((tuple(ints.shape), y.untyped_storage().nbytes()))
        return y

    monkeypatch.setattr(static_model._IntMatMul, "forward", staticmethod(spy_int_matmul))
    export_onnx.export_raw(static, 4, tmp_path / "raw", "g.onnx")
    assert len(traced) == len(linears)
    # no float weight: a traced linear owns only its float [4 rows, out] output
    assert all(storage == 4 * out * 4 for (out, _), storage in traced), traced

    raw = onnx.load(str(tmp_path / "raw" / "g.onnx"))
    assert [t.name for t in raw.graph.initializer if t.name in params] == []
    assert set(linears) <= {i.name for i in raw.graph.input}
    assert sum(len(t.raw_data) for t in raw.graph.initializer) < min(m.ints.numel() for m in linears.values())

    made = []
    weight_tensor, int_tensor = export_onnx.weight_tensor, export_onnx.int_tensor

    def spy(make):
        def spied(*args):
            assert not any(t.HasField("raw_data") and len(t.raw_data) >= export_onnx.EXTERNAL_THRESHOLD for t in made), \
                "finalize kept a weight's bytes in memory while making the next one"
            made.append(make(*args))
            return made[-1]
        return spied

    monkeypatch.setattr(export_onnx, "weight_tensor", spy(weight_tensor))
    monkeypatch.setattr(export_onnx, "int_tensor", spy(int_tensor))
    path = tmp_path / "out" / "g.onnx"
    export_onnx.finalize(tmp_path / "raw" / "g.onnx", path, params, linears)
    assert len(made) == len({i.name for i in raw.graph.input} & set(params))
    written = onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in written.graph.initializer}
    assert all(len(t.raw_data) < export_onnx.EXTERNAL_THRESHOLD for t in inits.values())
    external = [{e.key: e.value for e in t.external_data} for t in inits.values()
                if t.data_location == onnx.TensorProto.EXTERNAL]
    assert sum(int(e["length"]) for e in external) == path.with_name("g.onnx.data").stat().st_size  # each once
    for name, m in linears.items():
        ints, scale = inits[name], inits[name[:-len("ints")] + "scale"]
        for t in (ints, scale):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                load_external_data_for_tensor(t, str(path.parent))
        if ints.data_type == onnx.TensorProto.INT4:
            values = unpack_int4(ints.raw_data, m.ints.numel()).reshape(tuple(ints.dims))
        else:
            values = numpy_helper.to_array(ints)
        assert (m.bits <= 4) == (ints.data_type == onnx.TensorProto.INT4), name
        assert np.array_equal(values, m.int_values().numpy())
        assert np.array_equal(numpy_helper.to_array(scale), m.scale.numpy())



@pytest.mark.parametrize("graph", ["tree.onnx", "prefill.onnx"])
def test_cpu_session_dequantizes_each_weight_just_before_its_matmul(converted, graph, tmp_path):
    """ort_session's late_weight_dequant: onnxruntime's CPU EP starts every all-initializer DQ
    first (the whole model in fp32 before the first MatMul: 9.5 GiB at E2B size). After the
    rewrite no other MatMul runs between a weight's DQ and its own MatMul, while the plain
    session has many. Every weight's Transpose -> MatMul becomes a Gemm(transB). ort_session's
    outputs (both rewrites) are bit-identical to the plain session's."""
    import onnxruntime as ort

    from hyco.qnn.ort import gemm_for_transposed_weights, late_weight_dequant, ort_session

    path = converted["out"] / graph
    model = onnx.load(str(path), load_external_data=False)
    consumers = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def own_matmul(dq):
        out = dq.output[0]
        while consumers[out][0].op_type != "MatMul":
            out = consumers[out][0].output[0]
        return consumers[out][0].name

    weight_dqs = {n.name: own_matmul(n) for n in model.graph.node
                  if n.op_type == "DequantizeLinear" and n.input[0].endswith(".ints")}
    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    rng = np.random.default_rng(3)
    feeds = {i.name: (rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]) * 0.5)
             .astype(np.float32) for i in model.graph.input}

    def most_matmuls_in_between(proto) -> int:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "prof")
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
        order = [e["name"][:-len("_kernel_time")] for e in events
                 if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        at = {name: i for i, name in enumerate(order)}
        return max(sum(at[dq] < at[m] < at[mm] for m in matmuls) for dq, mm in weight_dqs.items())

    assert most_matmuls_in_between(model) > 5  # the trap, on this graph
    late = onnx.load(str(path), load_external_data=False)
    assert late_weight_dequant(late) == len(weight_dqs) > 0
    assert most_matmuls_in_between(late) == 0
    assert gemm_for_transposed_weights(onnx.load(str(path), load_external_data=False)) == len(weight_dqs)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as ort_session
    plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for a, b in zip(plain.run(None, feeds), ort_session(path).run(None, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_late_dequant_and_gemm_on_a_calibrator_tapped_weight_and_a_single_row(tmp_path):
    """onnxruntime's calibrator taps the Transpose of a weight with ReduceMin/ReduceMax: the DQ
    still waits for its MatMul's activation (measured: the 35-layer tree's calibrator held every
    weight in fp32, 9.7 GB). A one-row activation keeps its Transpose -> MatMul: MLAS has a GEMV
    kernel for M == 1 and a non-transposed B, so Gemm(transB) would not be bit-identical there."""
    from onnx import TensorProto, helper, numpy_helper

    from hyco.qnn.ort import gemm_for_transposed_weights, late_weight_dequant, ort_session

    rng = np.random.default_rng(0)
    ints = rng.integers(-8, 8, (48, 40)).astype(np.int8)
    scale = (rng.random(48) * 0.1 + 0.01).astype(np.float32)

    def graph(rows: int) -> onnx.ModelProto:
        nodes = [helper.make_node("DequantizeLinear", ["w.ints", "w.scale"], ["w"], axis=0, name="dq"),
                 helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0], name="t"),
                 helper.make_node("ReduceMax", ["wt"], ["wt_max"], keepdims=0, name="tap_max"),
                 helper.make_node("ReduceMin", ["wt"], ["wt_min"], keepdims=0, name="tap_min"),
                 helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, 40])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "wt_max", "wt_min")],
                              [numpy_helper.from_array(ints, "w.ints"), numpy_helper.from_array(scale, "w.scale")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])

    def untapped(rows: int) -> onnx.ModelProto:
        model = graph(rows)
        del model.graph.node[2:4]
        del model.graph.output[1:]
        return model

    tapped = graph(33)
    assert late_weight_dequant(tapped) == 1  # found its MatMul past the taps
    assert gemm_for_transposed_weights(tapped) == 0  # the taps read the transposed weight
    assert gemm_for_transposed_weights(untapped(33)) == 1
    assert gemm_for_transposed_weights(untapped(1)) == 0
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for rows in (33, 1):
        path = tmp_path / f"rows{rows}.onnx"
        onnx.save(untapped(rows), str(path))
        x = rng.standard_normal((1, rows, 40)).astype(np.float32)
        plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(ort_session(path).run(None, {"x": x})[0], plain)


def test_int8_weights_dequantized_once_per_session_give_the_same_bits(tmp_path):
    """ort_session holds each INT8 weight dequantized (and a DQ -> Transpose pair transposed) for
    the session's life instead of dequantizing it every pass; the outputs are bit-identical to
    onnxruntime's own session on the graph as written, at 33 rows and at one (MLAS's GEMV case),
    a weight read by two MatMuls included. Past the fp32 budget a weight stays a per-pass DQ, and
    so does a scalar constant (an 8-bit activation grid quantizes those too)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from hyco.qnn.ort import dequantize_int8_weights, ort_session

    rng = np.random.default_rng(5)
    a = rng.integers(-128, 128, (128, 64)).astype(np.int8)  # [out, in]: transposed for its MatMul
    b = rng.integers(0, 256, (128, 48)).astype(np.uint8)  # [in, out], a zero point, two readers
    inits = [numpy_helper.from_array(a, "a.ints"), numpy_helper.from_array((rng.random(128) * 0.05 + 1e-3).astype(np.float32), "a.scale"),
             numpy_helper.from_array(b, "b.ints"), numpy_helper.from_array((rng.random(48) * 0.05 + 1e-3).astype(np.float32), "b.scale"),
             numpy_helper.from_array(rng.integers(100, 156, 48).astype(np.uint8), "b.zero"),
             numpy_helper.from_array(np.array(200, np.uint8), "c.ints"), numpy_helper.from_array(np.array(0.01, np.float32), "c.scale")]

    def graph(rows: int) -> onnx.ModelProto:
        nodes = [helper.make_node("DequantizeLinear", ["a.ints", "a.scale"], ["a"], axis=0),
                 helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
                 helper.make_node("MatMul", ["x", "at"], ["h"]),
                 helper.make_node("DequantizeLinear", ["b.ints", "b.scale", "b.zero"], ["b"], axis=1),
                 helper.make_node("MatMul", ["h", "b"], ["y"]),
                 helper.make_node("DequantizeLinear", ["c.ints", "c.scale"], ["c"]),
                 helper.make_node("Mul", ["h", "c"], ["hc"]),
                 helper.make_node("MatMul", ["hc", "b"], ["z"])]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 64])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])

    held = graph(33)
    arrays = dequantize_int8_weights(held, tmp_path)
    assert sorted(arrays) == ["at/held", "b/held"] and arrays["at/held"].shape == (64, 128)
    # the 8-bit scalar (a constant on an 8-bit activation grid) stays a per-pass DQ
    assert [n.op_type for n in held.graph.node] == ["Identity", "MatMul", "Identity", "MatMul", "DequantizeLinear",
                                                    "Mul", "MatMul"]
    assert dequantize_int8_weights(graph(33), tmp_path, budget=4 * 128 * 64).keys() == {"at/held"}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for rows in (33, 1):
        path = tmp_path / f"rows{rows}.onnx"
        onnx.save(graph(rows), str(path))
        x = (rng.standard_normal((rows, 64)) * 4).astype(np.float32)
        plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        session = ort_session(path)
        assert len(session.hyco_held_weights[0]) == 2
        for got, want in zip(session.run(None, {"x": x}), plain, strict=True):
            np.testing.assert_array_equal(got, want)


def test_bench_cpu_session_times_both_sessions_and_finds_the_same_bits(converted):
    """bench/bench_cpu_session.py on the tiny tree graph: it opens the session with INT8 weights
    held and with them dequantized every pass, times both and says the outputs are the same bits."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "bench_cpu_session.py"), str(converted["out"] / "tree.onnx"),
                           "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "INT8 weights held in fp32" in done.stdout and "outputs the same bits: True" in done.stdout
    held = int(done.stdout.split(": ", 1)[1].split(" INT8")[0])
    assert held > 0


def test_late_dequant_never_makes_a_weight_wait_for_its_own_descendant():
    """A MatMul whose activation is computed from the weight itself (here scaled by the
    weight's max) must keep its plain DQ: waiting for that activation would close a cycle
    (onnxruntime refused such a rewritten full-size calibration graph: 'not acyclic')."""
    from onnx import TensorProto, helper, numpy_helper

    from hyco.qnn.ort import late_weight_dequant

    ints = np.arange(-8, 8, dtype=np.int8).reshape(4, 4)
    nodes = [helper.make_node("DequantizeLinear", ["w.ints", "w.scale"], ["w"], axis=0),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("ReduceMax", ["wt"], ["peak"], keepdims=0),
             helper.make_node("Mul", ["x", "peak"], ["act"]),
             helper.make_node("MatMul", ["act", "wt"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                          [numpy_helper.from_array(ints, "w.ints"),
                           numpy_helper.from_array(np.full(4, 0.5, np.float32), "w.scale")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    assert late_weight_dequant(model) == 0
    onnx.checker.check_model(model)


def test_convert_reports_what_the_published_file_holds(converted):
    """The parity-on conversion of tests/test_convert.py runs on the published family: the text
    model alone was loaded, and the report names the towers left on disk (bytes from the headers),
    the KV-shared layers' unused k/v and the float projection quantized here."""
    from hyco.base.loading import checkpoint_files, tower_tensors

    text = "model.language_model."
    report = json.loads((converted["out"] / "report.json").read_text())
    load = report["load"]
    assert report["layout"] == "multimodal" and report["bitexact_all_equal"]
    assert load["towers_left_on_disk"] == tower_tensors(checkpoint_files(converted["checkpoint"]))
    assert load["towers_left_on_disk"]["bytes"] > 0 and not load["extra"]
    assert len(load["unused_shared_kv"]) == 3 * 2 * 4  # 3 shared layers x k/v x (ints, scale, 2 SRQ)
    assert list(report["quantized_here"]) == [text + "per_layer_model_projection"]
    assert "Towers left on disk" in (converted["out"] / "summary.md").read_text()
