"""The recipe schema: round trips, validation messages, unknown keys, malformed YAML."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from hyco.base.errors import HycoError
from hyco.config.recipe import (
    CheckConfig,
    ConvertConfig,
    DatasetConfig,
    FixturesConfig,
    ModelsConfig,
    QatConfig,
    Recipe,
    VocabConfig,
    from_dict,
    load_recipe,
    to_dict,
)

RECIPES = sorted(Path(__file__).parents[1].joinpath("recipes").glob("*.yaml"))
SECTIONS = [ModelsConfig, DatasetConfig, FixturesConfig, VocabConfig, ConvertConfig, QatConfig, CheckConfig]


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_section_round_trips(cls):
    section = cls()
    assert from_dict(cls, to_dict(section), "test") == section
    # through YAML too, since tuples become lists there
    assert from_dict(cls, yaml.safe_load(yaml.safe_dump(to_dict(section))), "test") == section


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_load_and_round_trip(path):
    recipe = load_recipe(path)
    assert from_dict(Recipe, to_dict(recipe), str(path)) == recipe


def test_paper_settings_are_the_defaults():
    q, c, v = QatConfig(), CheckConfig(), VocabConfig()
    assert (q.steps, q.lr, q.warmup_steps, q.betas, q.grad_clip, q.grad_accumulation, q.weight_bits) == (
        100, 1e-5, 50, (0.9, 0.95), 1.0, 2, 4)
    assert (c.chain_depth, c.sibling_depths, c.budget, c.rate, c.epsilon) == (4, (1, 2), 32, 0.66, 0.005)
    assert (v.size, v.count_conversations, v.reserved_train) == (86_089, 20_000, 60)
    assert (ConvertConfig().ring_full, ConvertConfig().ring_sliding, ConvertConfig().rows) == (1024, 512, 33)


def test_the_real_model_recipe_carries_the_paper_numbers():
    r = load_recipe(Path(__file__).parents[1] / "recipes/hyco-gemma-4.yaml")
    assert r.stages == ("vocab", "answers", "convert", "qat", "calibrate", "export", "check")
    assert r.vocab.size == 86_089 and r.vocab.count_conversations == 20_000 and r.vocab.reserved_eval == 60
    assert (r.answers.source, r.answers.max_new_tokens_train, r.answers.max_new_tokens_eval) == ("greedy", 1024, 512)
    assert r.calibrate.prompts == 60 and (r.calibrate.kv_bits, r.calibrate.kv_margin, r.calibrate.kv_percentile) == (8, 1.2, 99.9)
    assert (r.convert.ring_full, r.convert.ring_sliding, r.convert.rows, r.export.soc_model) == (1024, 512, 33, 87)
    assert (r.qat.steps, r.qat.lr, r.qat.warmup_steps, r.qat.grad_accumulation) == (100, 1e-5, 50, 2)
    assert (r.check.chain_depth, r.check.budget, r.check.epsilon, r.check.top_k) == (4, 32, 0.005, 64)
    assert all(getattr(r.models, k) is None for k in ("tokenizer", "slm", "verifier", "assistant"))


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "name: x\nout: o\nstages: []\nqat:\n  stepz: 3\n")
    with pytest.raises(HycoError, match=r"r\.yaml\.qat: unknown key 'stepz'"):
        load_recipe(p)


def test_unknown_top_level_key(tmp_path):
    p = _write(tmp_path, "name: x\nout: o\nstages: []\nbogus: 1\n")
    with pytest.raises(HycoError, match="unknown key 'bogus'"):
        load_recipe(p)


def test_malformed_yaml_names_the_line(tmp_path):
    p = _write(tmp_path, "name: x\nout: [unclosed\nstages: []\n")
    with pytest.raises(HycoError, match=r"r\.yaml: malformed YAML at line"):
        load_recipe(p)


@pytest.mark.parametrize("text, message", [
    ("name: x\nout: o\nstages: []\nqat:\n  steps: many\n", r"qat\.steps must be an integer, but got 'many'"),
    ("name: x\nout: o\nstages: []\ncheck:\n  rate: 1.5\n", r"check\.rate must be in \(0, 1\), but got 1\.5"),
    ("name: x\nout: o\nstages: [vocab, fixtures]\nfixtures: {}\n", "stages must be unique and in the order"),
    ("name: x\nout: o\nstages: [compile]\n", "stages must be among"),
    ("name: x\nout: o\nstages: [fixtures]\n", "needs a fixtures section"),
    ("name: x\nout: o\nstages: []\nversion: 9\n", "version must be 1, but got 9"),
    ("name: x\nout: o\nstages: []\nfixtures:\n  preset: huge\n", r"fixtures\.preset must be one of \['tiny', 'tiny-text', 'tiny-e4b', 'e2b-shapes', 'e4b-shapes'\]"),
    ("name: x\nstages: []\n", "missing 1 required"),
])
def test_validation_messages(tmp_path, text, message):
    with pytest.raises(HycoError, match=message):
        load_recipe(_write(tmp_path, text))


def test_overrides_are_typed(tmp_path):
    p = _write(tmp_path, "name: x\nout: o\nstages: []\n")
    r = load_recipe(p, ["qat.steps=7", "models.slm=/data/e2b", "check.sibling_depths=[1]"])
    assert r.qat.steps == 7 and r.models.slm == "/data/e2b" and r.check.sibling_depths == (1,)
    with pytest.raises(HycoError, match="KEY=VALUE"):
        load_recipe(p, ["qat.steps"])


def test_out_placeholder_expands(tmp_path):
    r = load_recipe(_write(tmp_path, "name: x\nout: runs/x\nstages: []\nmodels:\n  slm: '{out}/fixtures/slm'\n"))
    assert r.path(r.models.slm) == Path("runs/x/fixtures/slm")
    assert r.path(r.models.slm, tmp_path) == tmp_path / "fixtures/slm"


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QatConfig().steps = 3


@pytest.mark.parametrize("value,ok", [
    ("{out}/fixtures/slm", True), ("{out}", True), ("/data/gemma", True), ("../models/slm", True),
    ("{out}/../elsewhere", False), ("{out}/a/../../b", False), ("/x/{out}/slm", False), ("{out}slm", False),
    ("{out}/a/{out}", False),
])
def test_out_paths_must_stay_inside_the_run_folder(tmp_path, value, ok):
    path = tmp_path / "r.yaml"
    path.write_text(f"name: r\nout: runs/r\nstages: [vocab]\nmodels: {{slm: '{value}'}}\n")
    if ok:
        assert load_recipe(path).models.slm == value
    else:
        with pytest.raises(HycoError, match="models.slm must stay inside the run folder"):
            load_recipe(path)


@pytest.mark.parametrize("text", ["qat: {lr: .nan}", "check: {top_p: .inf}", "check: {epsilon: -.inf}"])
def test_non_finite_numbers_are_refused(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(f"name: r\nout: runs/r\nstages: [vocab]\n{text}\n")
    with pytest.raises(HycoError, match="must be a finite number"):
        load_recipe(path)


# --- variants (`base:`) --------------------------------------------------------------------------------


def test_the_main_job_is_a_variant_of_the_real_recipe(tmp_path):
    """recipes/tiny.yaml states only how it differs from recipes/hyco-gemma-4.yaml: a setting it does
    not state comes from the real recipe file."""
    import shutil

    root = Path(__file__).parents[1] / "recipes"
    assert yaml.safe_load((root / "tiny.yaml").read_text())["base"] == "hyco-gemma-4.yaml"
    for name in ("tiny.yaml", "hyco-gemma-4.yaml"):
        shutil.copy(root / name, tmp_path / name)
    real = yaml.safe_load((tmp_path / "hyco-gemma-4.yaml").read_text())
    real["check"]["top_k"] = 17
    real["convert"]["rows"] = 21
    (tmp_path / "hyco-gemma-4.yaml").write_text(yaml.safe_dump(real))
    tiny = load_recipe(tmp_path / "tiny.yaml")
    assert (tiny.check.top_k, tiny.convert.rows) == (17, 21)
    assert tiny.convert.ring_full == 128 and tiny.name == "tiny"  # its own settings win
    assert load_recipe(root / "tiny.yaml").check.top_k == 64


def test_a_variant_merges_sections_and_replaces_lists(tmp_path):
    (tmp_path / "base.yaml").write_text("version: 1\nname: b\nout: o\nstages: [vocab, convert]\nvocab: {size: 10, reserved_train: 3}\n")
    (tmp_path / "v.yaml").write_text("base: base.yaml\nname: v\nstages: [vocab]\nvocab: {size: 20}\n")
    r = load_recipe(tmp_path / "v.yaml")
    assert (r.name, list(r.stages), r.vocab.size, r.vocab.reserved_train) == ("v", ["vocab"], 20, 3)


@pytest.mark.parametrize("case", ["missing", "cycle", "not-a-name"])
def test_a_bad_base_is_refused_naming_the_file(tmp_path, case):
    text = {"missing": "base: nope.yaml\n", "cycle": "base: v.yaml\n", "not-a-name": "base: [a]\n"}[case]
    (tmp_path / "v.yaml").write_text(text + "version: 1\nname: v\n")
    with pytest.raises(HycoError) as e:
        load_recipe(tmp_path / "v.yaml")
    assert ("nope.yaml" if case == "missing" else "v.yaml") in str(e.value)
