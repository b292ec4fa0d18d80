"""The `-ct` weight format (compressed-tensors, pack-quantized): the same tiny SLM written both ways
gives the same ints and scales, tensor by tensor (compressed-tensors' own unpack against ours), and
byte-identical convert outputs; a `-ct` file that is not the Gemma QAT format is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyco.base.errors import HycoError

SHIPPED_SLM = Path(__file__).parents[1] / "hyco" / "fixtures" / "shipped" / "tiny-seed0" / "slm"


@pytest.fixture(scope="module")
def ct_slm(tmp_path_factory):
    """The shipped undistilled tiny SLM (the ladder's) written again in the -ct layout."""
    from hyco.formats.ct_format import write_ct

    out = tmp_path_factory.mktemp("ct") / "slm-ct"
    write_ct(SHIPPED_SLM, out)
    return out


def test_the_ct_layout_holds_the_checkpoints_ints_and_scales(ct_slm):
    """compressed-tensors' own unpack of every weight_packed equals hyco/formats/gemma_quant.py's unpack of the
    -transformers tensor (an independent reader on each side), scales equal, other tensors the same
    bytes under their compressed-tensors names."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    from hyco.formats.gemma_quant import QatCheckpoint

    config = json.loads((ct_slm / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["ignore"] and config["kv_cache_scheme"]["num_bits"] == 8
    bits = {m: g["weights"]["num_bits"] for g in config["config_groups"].values() for m in g["targets"]}
    assert sorted(set(bits.values())) == [2, 4, 8]
    ckpt = QatCheckpoint(SHIPPED_SLM)
    seen = 0
    with safe_open(ct_slm / "model.safetensors", "pt") as f:
        for name in f.keys():
            if not name.endswith(".weight_packed"):
                continue
            module = name.removesuffix(".weight_packed")
            shape = torch.Size(f.get_tensor(f"{module}.weight_shape").tolist())
            ints = unpack_from_int32(f.get_tensor(name), bits[module], shape)
            read = ckpt.embedding if f"{module}.embedding_quantized" in ckpt else ckpt.linear
            theirs, scale, b = read(module, shape[1])
            assert b == bits[module] and torch.equal(ints, theirs), module
            assert torch.equal(f.get_tensor(f"{module}.weight_scale"), scale), module
            seen += 1
        assert torch.equal(f.get_tensor("model.language_model.layers.0.self_attn.k_scale"),
                           ckpt.tensor("model.language_model.layers.0.self_attn.k_cache_scale"))
    assert seen == len([n for n in ckpt.weight_map if n.endswith(("weight_scale", "embedding_scale"))])


def test_read_back_the_ct_layout_is_the_transformers_checkpoint_tensor_for_tensor(ct_slm, tmp_path, monkeypatch):
    """`gemma_layout`: the -ct folder's transcode (proven at write time) holds every tensor of the
    original -transformers checkpoint, same names, dtypes and bytes; made once, then reused; a
    -transformers folder is its own layout."""
    from safetensors import safe_open

    from hyco.formats.ct_format import gemma_layout

    monkeypatch.setenv("HYCO_CACHE", str(tmp_path / "cache"))
    folder = gemma_layout(ct_slm)
    assert folder.parent == tmp_path / "cache" / "gemma-layout"
    with safe_open(SHIPPED_SLM / "model.safetensors", "pt") as a, safe_open(folder / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert gemma_layout(ct_slm) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert gemma_layout(SHIPPED_SLM) == SHIPPED_SLM


def test_a_sharded_checkpoint_keeps_its_shards_both_ways(tmp_path, monkeypatch):
    """A checkpoint in two shards with an index (as the real ones are): the -ct copy and its
    transcode keep each tensor in its shard, and the transcode reads back tensor for tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hyco.formats.ct_format import gemma_layout, write_ct

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for p in SHIPPED_SLM.iterdir():
        if p.name != "model.safetensors":
            (sharded / p.name).write_bytes(p.read_bytes())
    with safe_open(SHIPPED_SLM / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    half = {n for n in names if ".layers.0." in n or "embed" in n}  # a module's tensors stay together
    files = {"model-00001-of-00002.safetensors": half, "model-00002-of-00002.safetensors": set(names) - half}
    for file, held in files.items():
        save_file({n: tensors[n] for n in sorted(held)}, str(sharded / file), metadata={"format": "pt"})
    weight_map = {n: file for file, held in files.items() for n in held}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_ct(sharded, tmp_path / "ct")
    ct_map = json.loads((tmp_path / "ct" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(ct_map.values()) == set(files) and not (tmp_path / "ct" / "model.safetensors").exists()
    monkeypatch.setenv("HYCO_CACHE", str(tmp_path / "cache"))
    folder = gemma_layout(tmp_path / "ct")
    back = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert back == weight_map
    for file in files:
        with safe_open(sharded / file, "pt") as a, safe_open(folder / file, "pt") as b:
            assert set(a.keys()) == set(b.keys())
            assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in a.keys()), file


def test_convert_writes_the_same_bytes_from_either_layout(ct_slm, ladder, tmp_path, monkeypatch):
    """The ladder's convert (the same tiny SLM in the -transformers layout) against convert on the
    -ct copy with the same recipe: every graph, LUT, rope and encodings file byte for byte; only the
    report names another checkpoint and format."""
    import hashlib

    from hyco.convert import stage
    from ladder import LADDER, RECIPE

    from hyco.config.recipe import load_recipe

    monkeypatch.setenv("HYCO_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(RECIPE, [*LADDER, f"models.slm={ct_slm}", f"models.tokenizer={ladder / 'fixtures' / 'tokenizer'}"])
    stage.build(recipe, ladder, tmp_path / "convert")

    def digests(folder: Path) -> dict[str, str]:
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("manifest.json", "stage.log")}

    ours, theirs = digests(tmp_path / "convert"), digests(ladder / "convert")
    assert set(ours) == set(theirs)
    assert [k for k in ours if ours[k] != theirs[k]] == ["report.json", "summary.md"]
    report = json.loads((tmp_path / "convert" / "report.json").read_text())
    assert report["weight_format"] == "compressed-tensors (-ct)" and report["bitexact_all_equal"]


def test_the_check_loads_a_ct_slm_as_the_same_model(ct_slm, tmp_path, monkeypatch):
    """check's torch SLM (runtime/inputs.load_model) on the -ct folder: the same logits as on the
    -transformers one."""
    from hyco.runtime.inputs import load_model

    monkeypatch.setenv("HYCO_CACHE", str(tmp_path / "cache"))
    ids = torch.tensor([[2, 105, 300, 107, 1200, 106]])
    with torch.no_grad():
        a = load_model(SHIPPED_SLM, "SLM")(input_ids=ids).logits
        b = load_model(ct_slm, "SLM")(input_ids=ids).logits
    assert torch.equal(a, b)


def test_preflight_takes_the_ct_format_for_the_slm(ct_slm):
    from hyco.pipeline.preflight import check_model

    assert check_model("slm", ct_slm) > 0


@pytest.mark.parametrize("damage", ["asymmetric", "bits3", "no_group", "packing"])
def test_a_ct_checkpoint_that_is_not_the_gemma_format_is_refused_by_name(ct_slm, tmp_path, damage):
    import shutil

    from safetensors.torch import load_file, save_file

    from hyco.formats.ct_format import to_gemma

    bad = tmp_path / "bad"
    shutil.copytree(ct_slm, bad)
    config = json.loads((bad / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    first = next(iter(groups.values()))
    module = "model.language_model.layers.0.self_attn.q_proj"
    if damage == "asymmetric":
        for g in groups.values():
            g["weights"]["symmetric"] = False
        want = "asymmetric"
    elif damage == "bits3":
        for g in groups.values():
            g["weights"]["num_bits"] = 3
        want = "unsupported bit width 3"
    elif damage == "no_group":
        for g in groups.values():
            g["targets"] = [t for t in g["targets"] if t != module]
        want = f"no config group targets module '{module}'"
    else:
        tensors = load_file(bad / "model.safetensors")
        tensors[f"{module}.weight_packed"] = tensors[f"{module}.weight_packed"][:, :-1].contiguous()
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
        want = f"tensor {module}.weight_packed is torch.int32"
    assert first  # the file has groups to damage
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(HycoError, match=want):
        to_gemma(bad, tmp_path / "out")
