"""export/: QNN context binaries for soc 87, bundle.json read back from the binaries, the splitter,
tampered bundles (the qai-hub path: tests/test_hub.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hyco.base.errors import HycoError
from hyco.config.recipe import ExportConfig

pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (QNN HTP backend absent)")


def test_unknown_soc_and_wrong_arch_are_refused():
    from hyco.qnn.contexts import soc_info

    assert soc_info(87) == ("SM8850", 81)
    with pytest.raises(HycoError, match="soc_model must be one of .*87 \\(SM8850, v81\\).*but got 99"):
        soc_info(99)
    with pytest.raises(HycoError, match="htp_arch must be 81 for soc_model 87"):
        soc_info(87, 79)


def test_export_cli_refuses_an_unknown_soc_before_any_work(tmp_path, capsys):
    from hyco.pipeline.cli import main

    args = [x for k in ("calibrate", "convert", "qat", "vocab") for x in (f"--{k}", str(tmp_path))]
    assert main(["export", *args, "--out", str(tmp_path / "out"), "--soc-model", "99"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "soc_model must be one of" in err[0] and "but got 99" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_graph_that_would_fall_back_to_cpu_fails_with_the_op_named(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from hyco.qnn.contexts import compile_context

    graph = helper.make_graph([helper.make_node("Abs", ["x"], ["a"], name="abs_ok"),
                               helper.make_node("Det", ["a"], ["y"], name="det_refused")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "det.onnx")
    with pytest.raises(HycoError, match="would fall back off the QNN HTP, first Det 'det_refused'"):
        compile_context(tmp_path / "det.onnx", tmp_path / "out", "det", soc_model=87)
    assert not list((tmp_path / "out").iterdir())  # no partial context


def test_isolated_compile_raises_the_child_s_error_and_counts_its_peak(tmp_path, monkeypatch):
    """The stage compiles in a fresh process (the QNN compiler keeps GBs after a 1 GB graph): the
    child's refusal comes back as the same HycoError, and a compile that worked counts in this
    process's peak RSS (the child's peak plus this process's RSS)."""
    import onnx
    from onnx import TensorProto, helper

    from hyco.base.memory import peak_rss_mb
    from hyco.qnn.contexts import compile_isolated

    def save(name: str, op: str) -> Path:
        graph = helper.make_graph([helper.make_node("Abs", ["x"], ["a"], name="abs_ok"),
                                   helper.make_node(op, ["a"], ["y"], name=f"{op.lower()}_node")], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / name)
        return tmp_path / name

    import hyco.base.memory

    noted = []
    monkeypatch.setattr(hyco.base.memory, "note_child_peak", lambda child, parent: noted.append(child))
    with pytest.raises(HycoError, match="would fall back off the QNN HTP, first Det 'det_node'"):
        compile_isolated(save("det.onnx", "Det"), tmp_path / "out", "det", soc_model=87)
    assert not list((tmp_path / "out").iterdir())
    compiled = compile_isolated(save("relu.onnx", "Relu"), tmp_path / "out", "relu", soc_model=87)
    assert compiled.binary.is_file() and compiled.context.is_file() and compiled.nodes >= 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([compiled.binary.name, compiled.context.name])
    # the child's own peak (an interpreter with onnxruntime-qnn loaded), not this pytest's
    assert len(noted) == 1 and 50 < noted[0] < peak_rss_mb()


def test_htp_optimization_level_reaches_the_compile_and_bad_levels_are_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from hyco.qnn.contexts import compile_context, compile_isolated, prepare_options

    assert prepare_options(0) == {"enable_htp_prepare_only": "1"}  # QNN's own default
    assert prepare_options(1)["htp_graph_finalization_optimization_mode"] == "1"
    with pytest.raises(ValueError, match="export.htp_optimization_level must be one of .*but got 5"):
        ExportConfig(htp_optimization_level=5)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "relu.onnx")
    with pytest.raises(HycoError, match="htp_optimization_level must be one of .*but got 4"):
        compile_context(tmp_path / "relu.onnx", tmp_path / "bad", "relu", soc_model=87, optimization_level=4)
    assert not (tmp_path / "bad").exists()  # refused before anything is written
    with pytest.raises(HycoError, match="htp_optimization_level must be one of .*but got 4"):  # reaches the worker
        compile_isolated(tmp_path / "relu.onnx", tmp_path / "bad", "relu", soc_model=87, optimization_level=4)
    for level in (1, 3):
        compiled = compile_context(tmp_path / "relu.onnx", tmp_path / f"o{level}", "relu", soc_model=87,
                                   optimization_level=level)
        assert compiled.binary.stat().st_size > 0 and compiled.nodes == 1


def test_export_compiles_every_graph_for_soc_87_and_binaries_match_io_spec(tiny_export):
    from hyco.npu.io_spec import read_io_spec
    from hyco.qnn.bundle import verify_bundle
    from hyco.qnn.system import binary_info

    bundle, summary = tiny_export
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["soc_model"] == 87 and meta["chip"] == "SM8850" and meta["htp_arch"] == 81
    assert meta["htp_optimization_level"] == 0  # QNN's default: what ships
    settled = meta["soc_settled"]  # asked of the installed QNN libraries at export, not copied from a table
    assert (settled["chip"], settled["soc_model"], settled["htp_arch"]) == ("SM8850", 87, 81)
    assert "libonnxruntime_providers_qnn.so" in settled["how"] and "libQnnSystem.so" in settled["how"]
    # one copy of the SLM's weights (export.slm_graphs tree-only): the tree graph prefills too
    assert set(meta["graphs"]) == {"tree", "mtp_step"} and meta["slm_graphs"] == "tree-only"
    specs = read_io_spec(bundle / "io_spec.json")
    assert set(specs) == {"tree.qdq.onnx", "mtp_step.qdq.onnx"} and meta["separate_prefill_rows"] == 16
    for role, g in meta["graphs"].items():
        (part,) = g["parts"]  # under the 2 GiB default nothing is split
        info = binary_info(bundle / part["binary"])  # read independently of what export recorded
        assert info["soc_model"] == 87 and info["htp_arch"] == 81 and info["build_id"].startswith("v2.")
        spec = specs[g["spec"]]
        for kind, tensors in (("inputs", spec.inputs), ("outputs", spec.outputs)):
            # QNN describes integer-code I/O (calibrate's uint8 KV) as fixed point: value =
            # scale * (code + offset), offset = -zero_point
            want = {}
            for t in tensors:
                codes = t.quant is not None and t.dtype.startswith("uint")
                want[t.name] = (t.shape, "ufixed" + t.dtype[4:] if codes else t.dtype,
                                (t.quant["scale"], -t.quant["zero_point"]) if codes else None)
            got = {t["name"]: (tuple(t["shape"]), t["dtype"], (t["scale"], t["offset"]) if "offset" in t else None)
                   for t in info["graphs"][0][kind]}
            assert set(got) == set(want), (role, kind)
            for name, (shape, dtype, q) in want.items():
                assert got[name][:2] == (shape, dtype), (role, name)
                if q is not None:
                    assert got[name][2][1] == q[1] and got[name][2][0] == pytest.approx(q[0], rel=1e-6), (role, name)
        assert g["weight_bytes"] > 0 and part["binary_bytes"] == (bundle / part["binary"]).stat().st_size
    verify_bundle(bundle)  # every sha256 and every binary's I/O check out
    footprint = meta["footprint"]  # read from the binaries: each context's resident bytes, independently here
    blobs = {p["binary"]: binary_info(bundle / p["binary"])["context_blob_bytes"]
             for g in meta["graphs"].values() for p in g["parts"]}
    assert footprint["resident_per_context"] == blobs and footprint["npu_resident_total"] == sum(blobs.values())
    assert all(0 < b < (bundle / name).stat().st_size for name, b in blobs.items())
    table3 = {r["item"]: r for r in footprint["table3"]}
    assert table3["SLM NPU graph"]["paper_bytes"] == 754_000_000
    assert table3["SLM NPU graph"]["bundle_bytes"] == blobs["tree_ctx_qnn.bin"]
    two = footprint["two_bit_weights"]  # the published map's 2-bit weights, as they ship and why
    assert two["weights_at_2_bits"] > 0 and two["bytes_in_int4_containers"] == 2 * two["bytes_at_2_bits"] > 0
    assert (two["encoding"], two["why"]) == (meta["two_bit_weights"]["encoding"], meta["two_bit_weights"]["why"])
    in_blocks = two["weights_in_int2_blocks"] == two["weights_at_2_bits"] and two["encoding"] == "int2-blocks"
    assert two["bytes_as_shipped"] == two["bytes_at_2_bits" if in_blocks else "bytes_in_int4_containers"]
    assert table3["MTP Drafter (graph + LUT)"]["bundle_bytes"] == (blobs["mtp_step_ctx_qnn.bin"]
                                                                  + meta["files"]["embed_lut.safetensors"]["bytes"])


@pytest.mark.parametrize("chip, number", [("SM8850", 87), ("SC8480XP", 88), ("SM8750", 69)])
def test_the_installed_qnn_libraries_settle_the_soc_number(chip, number):
    """SM8850 is 87 by the libraries that build and load the binaries; 88, which some sources give for
    it, is SC8480XP there."""
    from hyco.qnn.contexts import settle_soc

    settled = settle_soc(chip)
    assert settled["soc_model"] == number
    if chip == "SM8850":
        assert settled["htp_arch"] == 81


def test_an_unknown_chip_name_is_refused():
    from hyco.qnn.contexts import settle_soc

    with pytest.raises(HycoError, match="do not know the chip 'SM9999'"):
        settle_soc("SM9999")


def test_a_bundle_for_another_soc_is_refused_with_one_line(tiny_export, tiny_family, tmp_path, capsys):
    from hyco.pipeline.cli import main

    bundle, _ = tiny_export
    args = ["smoke", str(bundle), "--verifier", str(tiny_family["verifier"]), "--out", str(tmp_path / "smoke")]
    assert main([*args, "--soc-model", "69"]) == 2  # the bundle was built for 87
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built for soc_model 87 (SM8850), but this run targets soc_model 69 (SM8750)" in err[0], err

    relabelled = _tampered(bundle, tmp_path / "relabelled")  # bundle.json says SM8750; the binaries say otherwise
    meta = json.loads((relabelled / "bundle.json").read_text())
    meta.update(soc_model=69, chip="SM8750", htp_arch=79)
    (relabelled / "bundle.json").write_text(json.dumps(meta))
    assert main(["smoke", str(relabelled), "--verifier", str(tiny_family["verifier"]), "--soc-model", "69",
                 "--out", str(tmp_path / "smoke2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built for soc_model 87, but the bundle targets 69" in err[0], err
    assert not (tmp_path / "smoke").exists() and not (tmp_path / "smoke2").exists()


def test_the_check_on_the_htp_refuses_a_bundle_for_another_soc(ladder, tmp_path, capsys):
    from ladder import LADDER, RECIPE, set_args

    from hyco.pipeline.cli import main

    overrides = [*LADDER, "check.backend=qnn", "export.soc_model=69"]  # the ladder's bundle is for 87
    args = ["check", "--recipe", str(RECIPE), "--run-dir", str(ladder), "--out", str(tmp_path / "check"),
            *set_args(overrides)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "built for soc_model 87 (SM8850), but this run targets soc_model 69 (SM8750)" in err[0], err
    assert not (tmp_path / "check").exists()


def _tampered(bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    return copy


def _smoke_cli(bundle: Path, verifier: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "smoke", str(bundle), "--verifier", str(verifier),
                           "--prompts", "1", "--rounds", "1"], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_tampered_bundles_fail_smoke_with_one_line_naming_the_file(tiny_export, tiny_family, tmp_path):
    from hyco.base.files import sha256_file

    bundle, _ = tiny_export
    meta = json.loads((bundle / "bundle.json").read_text())
    binary = meta["graphs"]["tree"]["parts"][0]["binary"]

    flipped = _tampered(bundle, tmp_path / "flip")
    data = bytearray((flipped / binary).read_bytes())
    data[len(data) // 2] ^= 0x01
    (flipped / binary).write_bytes(bytes(data))
    done = _smoke_cli(flipped, tiny_family["verifier"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert str(flipped / binary) in done.stderr and "sha256" in done.stderr

    no_lut = _tampered(bundle, tmp_path / "lut")
    (no_lut / "luts" / "embed_tokens.safetensors").unlink()
    done = _smoke_cli(no_lut, tiny_family["verifier"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "embed_tokens.safetensors" in done.stderr

    # An io_spec that disagrees with the binary, in a bundle whose hashes are consistent again:
    # only reading the binary's own metadata can catch it.
    wrong = _tampered(bundle, tmp_path / "spec")
    spec = json.loads((wrong / "io_spec.json").read_text())
    tree = next(g for g in spec["graphs"] if g["graph"] == "tree.qdq.onnx")
    tree["inputs"][0]["shape"][0] += 1
    (wrong / "io_spec.json").write_text(json.dumps(spec))
    meta_w = json.loads((wrong / "bundle.json").read_text())
    meta_w["files"]["io_spec.json"] = {"bytes": (wrong / "io_spec.json").stat().st_size,
                                       "sha256": sha256_file(wrong / "io_spec.json")}
    (wrong / "bundle.json").write_text(json.dumps(meta_w))
    done = _smoke_cli(wrong, tiny_family["verifier"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "io_spec.json" in done.stderr and binary in done.stderr and tree["inputs"][0]["name"] in done.stderr


def _layered_graph(owners: int, shared: int, floats: int = 100):
    """A chain of MatMuls named as convert names them: `owners` layers with their own k_proj, then
    `shared` KV-shared layers (attention, no k_proj), each reading `floats` fp32 weights; a head
    outside every layer at the end."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []
    for layer in range(owners + shared):
        op = f"/layers.{layer}/attn/k_proj/MatMul" if layer < owners else f"/layers.{layer}/attn/MatMul"
        inits.append(numpy_helper.from_array(np.zeros((1, floats), np.float32), f"w{layer}"))
        nodes.append(helper.make_node("Mul", [f"x{layer}", f"w{layer}"], [f"x{layer + 1}"], name=op))
    nodes.append(helper.make_node("Identity", [f"x{owners + shared}"], ["logits"], name="/head/Identity"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, floats])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, floats])], inits)
    return helper.make_model(graph)


def test_parts_start_at_the_first_kv_shared_layer_and_share_the_rest_evenly():
    """compile_parts > 1: one part ends at the last layer owning K/V (its compile is far faster
    than with the layers reading that K/V beside it), and the parts are shared between owners and
    KV-shared layers so the largest is smallest; without KV-shared layers, or split only over the
    limit, the packing is as it was."""
    from hyco.export.split import kv_shared_layers, plan_parts

    model = _layered_graph(owners=4, shared=6)  # 400 weight bytes a layer
    assert kv_shared_layers(model) == {4, 5, 6, 7, 8, 9}
    # owners in one part (1,600 B), the six KV-shared layers in two (1,200 B each); owners in two
    # and the KV-shared in one would put 2,400 B in one part
    assert plan_parts(model, 2 * 1024**3, at_least=3) == [(-1, 3), (4, 6), (7, 9)]
    assert plan_parts(model, 2 * 1024**3, at_least=4) == [(-1, 1), (2, 3), (4, 6), (7, 9)]
    # two parts: the only split at the edge, 1,600 and 2,400 B (the even plan would be 2,000 each)
    assert plan_parts(model, 2 * 1024**3, at_least=2) == [(-1, 3), (4, 9)]
    # split only over the limit: greedy under it, the edge not forced (layers 3 and 4 share a part)
    assert plan_parts(model, 1300, at_least=1) == [(-1, 2), (3, 5), (6, 8), (9, 9)]
    plain = _layered_graph(owners=8, shared=0)
    assert kv_shared_layers(plain) == set()
    assert plan_parts(plain, 2 * 1024**3, at_least=2) == [(-1, 3), (4, 7)]
    with pytest.raises(HycoError, match="layer 0 alone holds 400 weight bytes"):
        plan_parts(model, 399, at_least=3)


@pytest.mark.slow
def test_splitter_on_tiny_tree_with_a_tiny_limit(tiny_calibrated, tmp_path):
    """Parts by layer ranges, each under the limit, chained on CPU equal the whole graph exactly;
    every part compiles for soc 87 with its I/O as planned."""
    from hyco.export.split import split_graph

    from hyco.qnn.bundle import check_binary_io, weight_bytes
    from hyco.qnn.contexts import ChainedSession, compile_context
    from hyco.qnn.ort import ort_session
    from hyco.qnn.system import binary_info

    graph = tiny_calibrated / "calibrate" / "tree.qdq.onnx"
    total = weight_bytes(graph)
    limit = total * 6 // 10
    from hyco.npu.io_spec import read_io_spec

    parts = split_graph(graph, tmp_path / "parts", limit, read_io_spec(graph.parent / "io_spec.json")[graph.name])
    assert len(parts) >= 2
    assert [s.meta["layers"][0] for _, s in parts][0] == -1
    for path, spec in parts:
        assert weight_bytes(path) <= limit, spec.meta
    whole = ort_session(graph)
    chain = ChainedSession([(ort_session(p), [t.name for t in s.inputs], [t.name for t in s.outputs]) for p, s in parts])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in whole.get_inputs():
        dtype = {"tensor(float)": np.float32, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16}[i.type]
        feeds[i.name] = (rng.standard_normal(i.shape) * 0.5).astype(dtype) if dtype == np.float32 \
            else rng.integers(0, 255, i.shape).astype(dtype)
    names = [o.name for o in whole.get_outputs()]
    for name, a, b in zip(names, whole.run(names, feeds), chain.run(names, feeds), strict=True):
        assert np.array_equal(a, b), name
    for path, spec in parts:
        compiled = compile_context(path, tmp_path / "ctx", path.stem.replace(".", "_"), soc_model=87)
        check_binary_io(binary_info(compiled.binary), spec, str(compiled.binary), "part spec")


@pytest.mark.slow
def test_parts_compiled_side_by_side_are_the_bytes_compiled_one_at_a_time(tiny_calibrated, tmp_path):
    """export.compile_parts 2: the tree graph in two balanced layer-range parts; compiled two at
    once (each in a fresh process) they are the binaries compiled one after the other: the same
    size and graph I/O, and the same bytes but a few. (QNN's compile of the part holding the head
    is not reproducible by itself: two fresh processes one after the other wrote 192 of 479,232
    bytes differently, in pairs; the other part was byte for byte equal every time.)"""
    from hyco.export.split import split_graph

    from hyco.base.files import sha256_file
    from hyco.npu.io_spec import read_io_spec
    from hyco.qnn.bundle import weight_bytes
    from hyco.qnn.contexts import compile_in_processes

    graph = tiny_calibrated / "calibrate" / "tree.qdq.onnx"
    parts = split_graph(graph, tmp_path / "parts", 2 * 1024**3, read_io_spec(graph.parent / "io_spec.json")[graph.name],
                        at_least=2)
    assert len(parts) == 2
    sizes = [weight_bytes(p) for p, _ in parts]
    assert max(sizes) < 0.75 * sum(sizes), sizes  # balanced, not one layer and the rest
    jobs = [(p, f"tree_part{i}") for i, (p, _) in enumerate(parts)]
    together = compile_in_processes(jobs, tmp_path / "together", soc_model=87, at_once=2)
    alone = compile_in_processes(jobs, tmp_path / "alone", soc_model=87, at_once=1)
    from hyco.qnn.system import binary_info

    for a, b in zip(together, alone, strict=True):
        x, y = np.fromfile(a.binary, np.uint8), np.fromfile(b.binary, np.uint8)
        assert a.binary.name == b.binary.name and x.size == y.size, a.binary.name
        assert binary_info(a.binary)["graphs"] == binary_info(b.binary)["graphs"], a.binary.name
        assert (x != y).sum() <= x.size // 1000, (a.binary.name, int((x != y).sum()))
    assert sha256_file(together[0].binary) == sha256_file(alone[0].binary)  # the first part: every byte


@pytest.mark.slow
def test_a_bundle_of_split_slm_graphs_smokes_through_its_chained_parts(tiny_export_distilled, tiny_family_distilled,
                                                                      tmp_path):
    """export.compile_parts 2 on both SLM graphs: each ships as two contexts, compiled side by side,
    chained on the simulator by smoke, which passes within calibrate's bounds; the footprint counts
    every part once."""
    from hyco.export.stage import ExportInputs, export

    from hyco.qnn.bundle import verify_bundle

    run, _ = tiny_export_distilled
    out = tmp_path / "export"
    inputs = ExportInputs(calibrate=run / "calibrate", convert=run / "convert", qat=run / "qat", vocab=run / "vocab",
                          tokenizer=tiny_family_distilled["tokenizer"], verifier=tiny_family_distilled["verifier"])
    export(inputs, out, ExportConfig(smoke_prompts=1, smoke_rounds=2, slm_graphs="separate", compile_parts=2))
    meta = verify_bundle(out / "bundle")
    for role in ("tree", "prefill"):
        assert [p["binary"] for p in meta["graphs"][role]["parts"]] == [f"{role}.part{i}_ctx_qnn.bin" for i in (0, 1)]
    assert len(meta["graphs"]["mtp_step"]["parts"]) == 1
    blobs = meta["footprint"]["resident_per_context"]
    assert len(blobs) == 5 and meta["footprint"]["npu_resident_total"] == sum(blobs.values())
    report = json.loads((out / "report.json").read_text())
    assert report["smoke"]["passed"], report["smoke"]
    assert {"tree", "prefill", "mtp_step"} <= set(json.loads((out / "smoke" / "report.json").read_text())["by_graph"])


def test_compiles_side_by_side_only_where_they_fit_in_memory():
    from hyco.export.stage import COMPILE_BYTES_PER_WEIGHT_BYTE, compile_workers

    from hyco.config.recipe import ExportConfig

    gib = 1024**3
    weights = [int(gib / COMPILE_BYTES_PER_WEIGHT_BYTE)] * 4  # each compile ~1 GiB
    assert compile_workers(ExportConfig(compile_workers=4, compile_memory_gb=4.5), weights) == 4
    assert compile_workers(ExportConfig(compile_workers=4, compile_memory_gb=2.5), weights) == 2
    assert compile_workers(ExportConfig(compile_workers=4, compile_memory_gb=0.5), weights) == 1  # one, whatever it needs
    assert compile_workers(ExportConfig(compile_workers=8, compile_memory_gb=100), weights) == 4  # no more than the jobs
    assert compile_workers(ExportConfig(compile_workers=2, compile_memory_gb=100), [gib, 1]) == 2
    # the largest first: a big part beside a small one must fit as a pair
    assert compile_workers(ExportConfig(compile_workers=2, compile_memory_gb=6.0), [gib, 1]) == 1
    with pytest.raises(ValueError, match="export.compile_parts must be >= 1"):
        ExportConfig(compile_parts=0)


# the qai-hub path (--hub) is tested in tests/test_hub.py


@pytest.mark.slow
def test_a_smoke_run_that_disagrees_stops_the_stage_and_nothing_moves_into_place(tiny_calibrated, tiny_family,
                                                                                  tmp_path, monkeypatch, capsys):
    """The stage ends with the smoke run on the bundle it just wrote; a disagreeing one is the
    stage's failed proof: one line with the figures, exit 1, no OUT; --allow-parity-failure keeps
    the bundle and the smoke report with the manifest marked. The smoke's verdict is stood in for
    here (its comparison is tests/test_smoke.py's)."""
    import hyco.export.smoke as smoke_module

    from hyco.pipeline.cli import main

    calls = []

    def failing_smoke(*, bundle, verifier, prompts, rounds, tolerance, isolate, out, named_as, soc_model,
                      verifier_tokenizer):
        assert verifier_tokenizer is None  # a verifier of the SLM's family: no token bridge
        calls.append({"bundle_json": (bundle / "bundle.json").is_file(), "verifier": verifier, "prompts": prompts,
                      "rounds": rounds, "tolerance": tolerance, "isolate": isolate, "out": out.name,
                      "soc_model": soc_model})
        out.mkdir(parents=True)
        (out / "report.json").write_text("{}")
        (out / "summary.md").write_text("smoke\n")
        return {"passed": False, "headline": "smoke FAILED: 1 prompts x 2 rounds", "summary_md": "## smoke\n", "passes": [],
                "by_graph": {"tree": {"max_logprob_diff": 0.4, "bound": 0.1, "id_mismatches": 3}}}

    monkeypatch.setattr(smoke_module, "smoke", failing_smoke)
    args = ["export", *[x for k in ("calibrate", "convert", "qat", "vocab") for x in (f"--{k}", str(tiny_calibrated / k))],
            "--tokenizer", str(tiny_family["tokenizer"]), "--verifier", str(tiny_family["verifier"]),
            "--smoke-prompts", "1", "--smoke-rounds", "2"]
    assert main([*args, "--out", str(tmp_path / "failed")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "proof failed: export: smoke FAILED: 1 prompts x 2 rounds (tree max |dlogprob| 0.4 " \
        "(bound 0.1), 3 id mismatches)" in err[0], err
    assert calls == [{"bundle_json": True, "verifier": Path(tiny_family["verifier"]), "prompts": 1, "rounds": 2,
                      "tolerance": ExportConfig().logprob_tolerance, "isolate": True, "out": "smoke", "soc_model": 87}]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no temp folder

    assert main([*args, "--out", str(tmp_path / "kept"), "--allow-parity-failure"]) == 0
    assert "WARNING: proof failed, bundle kept" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "kept" / "manifest.json").read_text())
    assert manifest["summary"]["smoke_passed"] is False and "smoke FAILED" in manifest["proof_failed"]
    assert {"smoke/report.json", "smoke/summary.md", "bundle/bundle.json"} <= set(manifest["outputs"])
    assert "Proof failed, bundle kept" in (tmp_path / "kept" / "summary.md").read_text()
    # the smoke's files vary with the simulator: declared with the reason, report.json only there
    declared = manifest["nondeterministic"]
    assert "simulator" in declared["smoke/report.json"]["reason"]
    assert {"/smoke", "/proof_failed"} <= set(declared["report.json"]["ignore_pointers"])


@pytest.mark.slow
def test_shared_context_is_one_binary_labelled_unverified_and_smoke_refuses_it(tiny_export_distilled,
                                                                                tiny_family_distilled, tmp_path):
    """On a calibration of both SLM graphs (export.slm_graphs separate): the shared context holds
    them in one binary, a separate bundle holds the weights twice."""
    from hyco.export.stage import ExportInputs, export

    from hyco.qnn.bundle import verify_bundle

    run, _ = tiny_export_distilled
    out = tmp_path / "export"
    inputs = ExportInputs(calibrate=run / "calibrate", convert=run / "convert", qat=run / "qat", vocab=run / "vocab",
                          tokenizer=tiny_family_distilled["tokenizer"], verifier=tiny_family_distilled["verifier"])
    export(inputs, out, ExportConfig(smoke_prompts=0, slm_graphs="shared"))
    meta = verify_bundle(out / "bundle")
    tree, prefill = meta["graphs"]["tree"], meta["graphs"]["prefill"]
    assert tree["parts"][0]["binary"] == prefill["parts"][0]["binary"]
    assert tree["shared_context"] and not tree["verified"] and "UNVERIFIED" in tree["note"]
    assert len(tree["parts"][0]["qnn_graphs"]) == 2 and not meta["graphs"]["mtp_step"]["shared_context"]
    shared_bytes = tree["parts"][0]["binary_bytes"]
    # one copy of the SLM's weights on the device: the shared context counts once (fails if duplicated)
    footprint, shared_bin = meta["footprint"], tree["parts"][0]["binary"]
    slm = next(r for r in footprint["table3"] if r["item"] == "SLM NPU graph")
    assert slm["bundle_bytes"] == footprint["resident_per_context"][shared_bin]
    assert footprint["npu_resident_total"] == sum(footprint["resident_per_context"].values())
    assert len(footprint["resident_per_context"]) == 2
    assert len(list((out / "bundle").glob("*.bin"))) == 2  # shared tree+prefill, and mtp_step
    # against the ladder's two separate contexts: sharing saves one copy of the weights (graph
    # metadata differs a little between the two layouts, hence 0.9)
    export(inputs, tmp_path / "separate", ExportConfig(smoke_prompts=0, slm_graphs="separate"))
    meta = verify_bundle(tmp_path / "separate" / "bundle")
    separate, blobs = meta["graphs"], meta["footprint"]["resident_per_context"]
    assert set(separate) == {"tree", "prefill", "mtp_step"} and meta["separate_prefill_rows"] is None
    slm_row = next(r for r in meta["footprint"]["table3"] if r["item"] == "SLM NPU graph")
    assert slm_row["bundle_bytes"] == blobs["tree_ctx_qnn.bin"] + blobs["prefill_ctx_qnn.bin"]  # the weights twice
    saved = sum(separate[r]["parts"][0]["binary_bytes"] for r in ("tree", "prefill")) - shared_bytes
    assert saved >= 0.9 * tree["weight_bytes"], (saved, tree["weight_bytes"])
    done = _smoke_cli(out / "bundle", tiny_family_distilled["verifier"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "cannot load a shared" in done.stderr
    print(f"shared tree+prefill context: {shared_bytes} B")


def test_a_separate_prefill_graph_needs_its_calibration(tiny_calibrated, tmp_path):
    """The ladder calibrates the tree graph alone (export.slm_graphs tree-only): exporting it with a
    separate prefill graph is refused in one line that says how to get one, and writes nothing."""
    from hyco.export.stage import ExportInputs, export

    with pytest.raises(HycoError, match=r"no prefill.qdq.onnx \(prefill graph\) .*calibrate builds the prefill graph "
                                        r"only for export.slm_graphs separate or shared"):
        export(ExportInputs(calibrate=tiny_calibrated / "calibrate", convert=tiny_calibrated / "convert",
                            qat=tiny_calibrated / "qat", vocab=tiny_calibrated / "vocab"),
               tmp_path / "export", ExportConfig(smoke_prompts=0, slm_graphs="separate"))
    assert not (tmp_path / "export" / "bundle" / "bundle.json").exists()


def test_the_footprint_compares_with_the_recipes_targets():
    """Table 3's targets come from the recipe (export.footprint_targets): another model's own
    numbers, only the rows it names; the default is the paper's E2B table."""
    from hyco.config.recipe import TABLE3_E2B, ExportConfig
    from hyco.qnn.bundle import device_footprint

    graphs = {"tree": {"parts": [{"binary": "tree.bin", "context_blob_bytes": 600}]},
              "prefill": {"parts": [{"binary": "prefill.bin", "context_blob_bytes": 400}]},
              "mtp_step": {"parts": [{"binary": "mtp.bin", "context_blob_bytes": 100}]}}
    files = {"embed_lut.safetensors": {"bytes": 50}, "luts/per_layer.npy": {"bytes": 7}}
    rows = {r["item"]: r for r in device_footprint(graphs, files, targets={"slm": 2000.0, "mtp_drafter": 100.0})["table3"]}
    assert set(rows) == {"SLM NPU graph", "MTP Drafter (graph + LUT)"}
    assert rows["SLM NPU graph"]["bundle_bytes"] == 1000 and rows["SLM NPU graph"]["vs_paper"] == -0.5
    assert rows["MTP Drafter (graph + LUT)"]["bundle_bytes"] == 150 and rows["MTP Drafter (graph + LUT)"]["vs_paper"] == 0.5
    assert ExportConfig().footprint_targets == TABLE3_E2B
    with pytest.raises(ValueError, match="footprint_targets must map some of"):
        ExportConfig(footprint_targets={"lm_head": 1.0})


def test_a_binary_over_the_session_budget_is_refused_naming_it_and_nothing_is_moved(tiny_calibrated, tmp_path,
                                                                                      capsys):
    """HTP sessions fail around 3.5-4 GB (export.max_session_bytes): a compiled context above the
    recipe's budget stops the stage with one line naming the part and its bytes, no bundle kept;
    the split target can never exceed the budget."""
    from hyco.pipeline.cli import main
    from hyco.qnn.bundle import weight_bytes

    tree = tiny_calibrated / "calibrate" / "tree.qdq.onnx"
    weights = weight_bytes(tree)
    budget = weights + 1  # the weights fit (no split), the compiled graph with them does not
    out = tmp_path / "export"
    assert main(_export_under_budget(tiny_calibrated, out, budget)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the tree context binary is" in err[0] and f"over export.max_session_bytes {budget:,}" \
        in err[0], err
    assert "tree_ctx_qnn.bin" in err[0] and not out.exists()
    assert ExportConfig().max_session_bytes == 3_500_000_000
    with pytest.raises(ValueError, match="max_context_bytes must be > 0 and <= export.max_session_bytes"):
        ExportConfig(max_context_bytes=4 * 10**9)


def _export_under_budget(run: Path, out: Path, budget: int) -> list[str]:
    """`export` of the ladder's run with no smoke and `budget` as both the context and session limit."""
    return ["export", "--calibrate", str(run / "calibrate"), "--convert", str(run / "convert"), "--qat", str(run / "qat"),
            "--vocab", str(run / "vocab"), "--out", str(out), "--smoke-prompts", "0", "--max-context-bytes", str(budget),
            "--max-session-bytes", str(budget)]


def test_a_bundle_over_the_session_budget_together_is_refused_naming_its_contexts(tiny_calibrated, tmp_path, capsys):
    """The phone loads tree, prefill and the MTP step into one HTP session: each context fits the
    budget alone here, together they do not, and export refuses the bundle in one line naming each
    context with its bytes and the ways out; nothing is moved into place."""
    import json

    from hyco.pipeline.cli import main

    bundle = json.loads((tiny_calibrated / "export" / "bundle" / "bundle.json").read_text())
    contexts = bundle["footprint"]["resident_per_context"]
    session = bundle["footprint"]["session"]
    assert session["resident_bytes"] == sum(contexts.values()) and session["fits"]
    budget = (max(contexts.values()) + sum(contexts.values())) // 2  # over the largest, under the sum
    out = tmp_path / "export"
    assert main(_export_under_budget(tiny_calibrated, out, budget)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "into one HTP session" in err[0] and f"over export.max_session_bytes {budget:,}" in err[0]
    for name in contexts:
        assert name in err[0], name
    assert "ways out" in err[0] and not out.exists()


def test_preflight_estimates_the_session_from_the_checkpoints_below_what_ships(tiny_calibrated, tmp_path):
    """The estimate counts the weights at their graph widths only, so it stays under the compiled
    bundle's resident bytes (a bundle it refuses is over the budget compiled too), and a budget
    below it is refused before any stage runs."""
    import json

    from ladder import LADDER, RECIPE

    from hyco.config.recipe import load_recipe
    from hyco.pipeline.preflight import npu_session_estimate, session_over_budget

    fixtures = tiny_calibrated / "fixtures"
    recipe = load_recipe(RECIPE, [*LADDER, f"models.slm={fixtures / 'slm'}", f"models.assistant={fixtures / 'assistant'}"])
    estimate, what = npu_session_estimate(recipe, tmp_path / "run")
    shipped = json.loads((tiny_calibrated / "export" / "bundle" / "bundle.json").read_text())["footprint"]["session"]
    assert 0 < estimate < shipped["resident_bytes"], (estimate, shipped)
    assert "1 copy of the SLM's weights" in what and "MTP head" in what  # export.slm_graphs tree-only
    assert session_over_budget(recipe, (estimate, what)) == []
    low = load_recipe(RECIPE, [*LADDER, f"export.max_session_bytes={estimate - 1}", f"export.max_context_bytes={estimate - 1}"])
    refused = session_over_budget(low, (estimate, what))
    assert len(refused) == 1 and "over export.max_session_bytes" in refused[0]
