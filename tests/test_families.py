"""The family registry (hyco/config/families.py): every stage asks it which checkpoints it converts, so
a checkpoint of an unregistered family is refused once, in one line listing what is registered."""

from __future__ import annotations

import importlib
import json

import pytest

from hyco.base.errors import HycoError
from hyco.config.families import FAMILIES, GEMMA4, architecture, family_of, head_of, registered
from hyco.pipeline.cli import main

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}


def test_each_family_is_whole():
    """Every model type implies an architecture with a layout; every head's step module and
    capture resolve; the graph I/O's layer-type table is the family's."""
    from hyco.npu.host import SHORT

    for family in FAMILIES.values():
        assert set(family.architectures.values()) <= set(family.layouts), family.name
        for head in family.heads.values():
            assert set(head.reads) <= set(family.layer_types), head.model_type
            for ref in (head.step, head.capture):
                module, name = ref.split(":")
                assert callable(getattr(importlib.import_module(module), name)), ref
    assert SHORT is GEMMA4.layer_types
    assert architecture({"model_type": "gemma4_text", "architectures": None}) == "Gemma4ForCausalLM"


def test_an_unknown_family_is_one_line_listing_the_registered_ones():
    with pytest.raises(HycoError, match=r"x/config.json: model_type 'llama' is no registered family's "
                                        r"\(registered: gemma4 \(gemma4_text, gemma4\)\)"):
        family_of(LLAMA, "x/config.json")
    with pytest.raises(HycoError, match="no registered MTP head .registered: gemma4 .gemma4_assistant"):
        head_of({"model_type": "eagle3"}, "h/config.json")
    with pytest.raises(HycoError, match="models.family 'qwen3' is not a registered family"):
        family_of({"model_type": "gemma4"}, "c", name="qwen3")
    assert family_of({"model_type": "gemma4"}, "c", name="gemma4") is GEMMA4
    assert "gemma4 (gemma4_text, gemma4)" == registered()


def _llama_folder(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA))
    return path


def test_convert_refuses_another_family_naming_the_file(tmp_path, capsys):
    folder = _llama_folder(tmp_path / "llama")
    assert main(["convert", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder}/config.json: model_type 'llama' is no registered family's" in err[0], err
    assert not (tmp_path / "out").exists()


def test_run_refuses_another_family_before_any_stage(tmp_path, capsys):
    """Preflight: models.slm of an unregistered family, and models.family unknown or not the
    checkpoint's, each one line before a stage starts."""
    from hyco.pipeline.preflight import check_model

    folder = _llama_folder(tmp_path / "llama")
    assert main(["run", "recipes/tiny.yaml", "--out", str(tmp_path / "run"), "--set", f"models.slm={folder}",
                 "--set", "stages=[convert]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(models.slm): model_type 'llama' is no registered family's" in err[0], err
    assert main(["run", "recipes/tiny.yaml", "--out", str(tmp_path / "run"), "--set", "models.family=llama"]) == 2
    assert "models.family must be a registered family (gemma4 (gemma4_text, gemma4)) or null, but got 'llama'" \
        in capsys.readouterr().err
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
    FAMILIES["other"] = GEMMA4.__class__(**{**GEMMA4.__dict__, "name": "other", "architectures": {}})
    try:
        with pytest.raises(HycoError, match=r"a gemma4 checkpoint, but models.family is 'other'"):
            check_model("verifier", gemma, family="other")
    finally:
        del FAMILIES["other"]
