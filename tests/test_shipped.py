"""The shipped tiny families: current, intact, used by the fixtures stage, and one draw of the
generator byte for byte (the slow tier draws each afresh)."""

from __future__ import annotations

import json
import shutil

import pytest

from hyco.base.errors import HycoError
from hyco.fixtures import shipped
from hyco.fixtures.cache import generate_family, source_hash


@pytest.mark.parametrize("name", sorted(shipped.SHIPPED))
def test_shipped_family_is_current_and_intact(name):
    options = shipped.SHIPPED[name]
    manifest = json.loads((shipped.SHIPPED_ROOT / name / shipped.MANIFEST).read_text())
    assert manifest["key"] == source_hash(options, versions=False), (
        f"the generator changed since {name} was drawn: refresh it with `python -m hyco.fixtures.shipped {name}`")
    assert shipped.verified_shipped(options) == shipped.SHIPPED_ROOT / name
    if "cross_family" in options:  # one verifier folder, its tokenizer inside
        want = {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "report.json"}
    else:
        want = {"tokenizer/tokenizer.json", "slm/config.json", "verifier/config.json", "assistant/config.json",
                "family.json"}
    assert want <= set(manifest["files"])


@pytest.mark.parametrize("damage", ["flip", "remove", "extra"])
def test_a_damaged_shipped_copy_is_refused_naming_the_file(tmp_path, monkeypatch, damage):
    name = "tiny-seed0"
    root = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_ROOT / name, root / name)
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", root)
    target = root / name / "slm" / "config.json"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[10] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "remove":
        target.unlink()
    else:
        target = root / name / "slm" / "stray.bin"
        target.write_bytes(b"x")
    with pytest.raises(HycoError) as err:
        shipped.copy_shipped(shipped.SHIPPED[name], tmp_path / "out")
    assert ("stray.bin" if damage == "extra" else str(target)) in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_stale_shipped_copy_is_not_used(tmp_path, monkeypatch):
    name = "tiny-seed0"
    root = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_ROOT / name, root / name)
    manifest = json.loads((root / name / shipped.MANIFEST).read_text())
    manifest["key"] = "0" * 16  # drawn by another version of the generator
    (root / name / shipped.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", root)
    assert shipped.copy_shipped(shipped.SHIPPED[name], tmp_path / "out") is None
    assert shipped.verified_shipped({"preset": "tiny", "seed": 1, "distill": False}) is None  # no such draw


def test_fixtures_stage_copies_the_shipped_draw(tmp_path):
    from hyco.config.recipe import FixturesConfig
    from hyco.fixtures.stage import build_fixtures

    out = tmp_path / "fixtures"
    out.mkdir()
    summary = build_fixtures(config=FixturesConfig(preset="tiny", seed=0, distill=True), out=out)
    report = json.loads((out / "report.json").read_text())
    assert report["origin"]["shipped"] == "hyco/fixtures/shipped/tiny-seed0-distilled"
    assert shipped.compare_families(shipped.SHIPPED_ROOT / "tiny-seed0-distilled", out) == [
        f"only in {out}: {f}" for f in ("report.json", "slm_bits.png", "summary.md")]
    assert "Copied from the package's shipped draw" in (out / "summary.md").read_text()
    assert summary["distill"] and summary["slm"] > 0


def test_compare_families_sees_a_changed_byte_but_not_a_wall_time(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        shutil.copytree(shipped.SHIPPED_ROOT / "tiny-seed0-distilled", folder)
    report = json.loads((b / "distill_report.json").read_text())
    report["wall_s"] += 1.0
    report["verifier"]["wall_s"] += 2.0
    (b / "distill_report.json").write_text(json.dumps(report))
    assert shipped.compare_families(a, b) == []
    report["verifier"]["steps"] += 1
    (b / "distill_report.json").write_text(json.dumps(report))
    shard = b / "verifier" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert shipped.compare_families(a, b) == ["differs: distill_report.json",
                                              "differs: verifier/model.safetensors"]


# A distillation shortened to seconds that still runs every step of the full one (training, the
# sharpening walk, sampled continuations, quantization and packing): determinism is a property of
# the code path and the machine's kernels, not of the step count.
SHORT = {"verifier_steps": 12, "sharpen_scales": (1.5, 2.0), "sharpen_prompts": 6, "slm_steps": 6, "head_steps": 6,
         "train_conversations": 200, "heldout_conversations": 6, "samples": 8, "sample_tokens": 32}


@pytest.mark.slow
def test_two_fresh_draws_on_one_machine_are_byte_identical(tmp_path):
    """Float training is byte-reproducible on one machine (same kernels, same reduction order)."""
    options = {**shipped.SHIPPED["tiny-seed0-distilled"], **SHORT}
    for draw in ("a", "b"):
        generate_family(tmp_path / draw, options)
    assert shipped.compare_families(tmp_path / "a", tmp_path / "b") == []


@pytest.mark.slow
def test_a_fresh_random_draw_equals_the_shipped_family_byte_for_byte(tmp_path):
    """The undistilled family is random init, quantization and packing: no training, no float
    accumulation, so its bytes hold across CPUs and releases (the writer's version stamp aside)."""
    name = "tiny-seed0"
    generate_family(tmp_path / name, shipped.SHIPPED[name])
    assert shipped.compare_families(shipped.SHIPPED_ROOT / name, tmp_path / name) == []


@pytest.mark.slow
def test_a_fresh_distilled_draw_matches_the_shipped_family_by_its_figures(tmp_path):
    """Minutes: the whole distillation runs again. Float training reduces in the order the CPU's
    kernels choose (AVX2, AVX-512, AMX, oneDNN's ISA, the thread count), so across machines and
    torch releases a draw is held to the shipped one by its figures (shipped.FIGURE_TOLERANCES,
    each with its reason), and the files that no training touches (tokenizer, configs) byte for byte."""
    name = "tiny-seed0-distilled"
    generate_family(tmp_path / name, shipped.SHIPPED[name])
    assert shipped.figure_differences(shipped.SHIPPED_ROOT / name, tmp_path / name) == []
    untrained = [d for d in shipped.compare_families(shipped.SHIPPED_ROOT / name, tmp_path / name)
                 if not d.endswith((".safetensors", "distill_report.json"))]
    assert untrained == []


@pytest.mark.slow
def test_a_fresh_cross_family_draw_matches_the_shipped_verifier(tmp_path):
    """The token bridge's verifier of another family (~30 s of training): its tokenizer (BPE
    merges learned deterministically) and configs byte for byte, its training by the last loss
    (float training reduces in the CPU's order, as for the distilled family)."""
    name = "cross-family-seed0"
    generate_family(tmp_path / name, shipped.SHIPPED[name])
    diffs = shipped.compare_families(shipped.SHIPPED_ROOT / name, tmp_path / name)
    assert [d for d in diffs if not d.endswith(("model.safetensors", "report.json"))] == []
    shipped_report, fresh = (json.loads((f / "report.json").read_text()) for f in (shipped.SHIPPED_ROOT / name,
                                                                                   tmp_path / name))
    # the distilled verifier's loss moved by 0.002-0.008 across CPUs (FIGURE_TOLERANCES): the same bound
    assert abs(shipped_report["loss_last"] - fresh["loss_last"]) <= 0.1
    assert {k: v for k, v in shipped_report.items() if not k.startswith(("loss", "wall"))} == \
        {k: v for k, v in fresh.items() if not k.startswith(("loss", "wall"))}


def test_figure_differences_name_the_figure_and_the_tolerance(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        shutil.copytree(shipped.SHIPPED_ROOT / "tiny-seed0-distilled", folder)
    assert shipped.figure_differences(a, b) == []
    report = json.loads((b / "distill_report.json").read_text())
    report["verifier"]["loss_last"] += 1.0
    report["slm"]["top1_qat"]["heldout"] -= 0.5
    (b / "distill_report.json").write_text(json.dumps(report))
    diffs = shipped.figure_differences(a, b)
    assert len(diffs) == 2 and diffs[0].startswith("verifier.loss_last: ") and "tolerance" in diffs[0]
    assert diffs[1].startswith("slm.top1_qat.heldout: ")
