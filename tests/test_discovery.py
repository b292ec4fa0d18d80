"""Finding one's way around the CLI: the version, the packaged recipes (listed, run by name from any
folder, shipped in the wheel), `plan` (every problem at once; what `run` would build or reuse),
one-line command-line errors, help generated from the registries the code uses, and errors that
point at the fix."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from hyco.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(ROOT.joinpath("recipes").glob("*.yaml"))


def _stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _help(argv: list[str], capsys, monkeypatch) -> str:
    """The help text of `argv`, on one line (COLUMNS wide: argparse wraps at the terminal's width)."""
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_version_is_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hyco-convert {version('hyco-convert')}"


# --- the packaged recipes ----------------------------------------------------------------------------


def test_recipes_lists_every_shipped_recipe_with_its_description(capsys):
    assert main(["recipes"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert sorted(rows) == sorted(p.stem for p in SHIPPED)
    for path in SHIPPED:
        assert rows[path.stem] == yaml.safe_load(path.read_text())["description"], path.name
    assert rows["tiny"].startswith("The embedded default")


def test_a_variant_does_not_inherit_its_bases_description():
    from hyco.config.recipe import load_recipe

    assert load_recipe("tiny").description != load_recipe("hyco-gemma-4").description


@pytest.fixture(scope="module")
def tiny_by_name(tmp_path_factory) -> Path:
    """`hyco-convert run tiny` (its fixtures stage only) from a folder outside the checkout."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        assert main(["run", "tiny", "--set", "stages=[fixtures]"]) == 0
    finally:
        os.chdir(before)
    return cwd


def test_run_resolves_a_packaged_recipe_by_name_from_any_folder(tiny_by_name):
    # the recipe's relative paths are the working directory's, not the package's
    assert (tiny_by_name / "runs" / "tiny" / "fixtures" / "manifest.json").is_file()
    assert (tiny_by_name / "runs" / "tiny" / "run_report.json").is_file()


def test_a_name_finds_the_package_and_its_base_and_a_file_wins(tmp_path, monkeypatch):
    from hyco.base.errors import HycoError
    from hyco.config.recipe import find_recipe, load_recipe

    monkeypatch.chdir(tmp_path)
    assert find_recipe("tiny") == find_recipe("tiny.yaml") and find_recipe("tiny").name == "tiny.yaml"
    recipe = load_recipe("tiny")
    assert recipe.check.top_k == 64 and recipe.stages[-1] == "check"  # from its base, hyco-gemma-4.yaml, packaged
    assert recipe.path(recipe.out) == Path("runs/tiny")
    (tmp_path / "tiny.yaml").write_text("version: 1\nname: mine\nout: here\nstages: [vocab]\n")
    assert load_recipe("tiny.yaml").name == "mine"
    with pytest.raises(HycoError, match=r"recipe not found: nope \(neither a file nor a packaged recipe: .*tiny"):
        load_recipe("nope")


def test_the_wheel_ships_the_recipes(tmp_path):
    """Built from a copy of the sources (the build writes build/ and egg-info beside them)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    src = tmp_path / "src"
    for folder in dict.fromkeys(config["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*.tmp-*"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"hyco/recipes/{p.name}" for p in SHIPPED} <= names


# --- plan ----------------------------------------------------------------------------------------------


def test_plan_lists_every_missing_input_at_once_and_run_counts_them(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    missing = {role: str(tmp_path / f"no-{role}") for role in ("slm", "verifier", "tokenizer")}
    recipe.write_text(yaml.safe_dump({"version": 1, "name": "r", "out": str(tmp_path / "run"),
                                      "stages": ["vocab", "answers", "convert"], "models": missing}))
    assert main(["plan", str(recipe)]) == 2
    out = capsys.readouterr()
    errors = out.err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("hyco-convert plan: error: ") for e in errors), errors
    assert all(any(path in e for e in errors) for path in missing.values()), errors
    assert "models.slm" in out.err and "models.verifier" in out.err
    assert re.search(r"^  vocab +build +not built yet", out.out, re.M)
    assert "[preflight] convert: not estimated (its slm could not be read)" in out.out
    assert not (tmp_path / "run").exists()
    assert main(["run", str(recipe)]) == 2
    errors = _stderr_lines(capsys)
    assert len(errors) == 1 and "(and 2 more problems: `hyco-convert plan RECIPE` lists all)" in errors[0], errors


def test_plan_says_reuse_for_a_finished_stage_and_build_for_the_rest(tiny_by_name, capsys, monkeypatch):
    monkeypatch.chdir(tiny_by_name)
    assert main(["plan", "tiny"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  fixtures +reuse +runs/tiny/fixtures matches its recipe section and inputs", out, re.M)
    assert re.search(r"^  vocab +build +not built yet", out, re.M)
    assert re.search(r"^  answers +build +it reads vocab, which is rebuilt", out, re.M)
    assert "[preflight] check:" in out and "no problems found" in out
    # a changed section is rebuilt
    assert main(["plan", "tiny", "--set", "fixtures.seed=1"]) == 0
    assert re.search(r"^  fixtures +build +its recipe section or inputs changed", capsys.readouterr().out, re.M)


# --- one grammar, one-line errors ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, command", [
    ([], "hyco-convert"),
    (["no-such-command"], "hyco-convert"),
    (["run"], "hyco-convert run"),
    (["check", "tiny", "--no-such-flag"], "hyco-convert check"),
    (["check", "tiny", "--prompts", "many"], "hyco-convert check"),
    (["convert", "--out", "o"], "hyco-convert convert"),
    (["smoke", "bundle"], "hyco-convert smoke"),
])
def test_a_bad_command_line_is_one_line_pointing_at_the_help(argv, command, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"{command}: error: "), err
    assert err[0].endswith(f"see '{command} --help'"), err


@pytest.mark.parametrize("argv, flag", [(["check", "tiny", "--prompts", "0"], "--prompts"),
                                        (["smoke", "b", "--verifier", "v", "--prompts", "0"], "--prompts"),
                                        (["smoke", "b", "--verifier", "v", "--rounds", "0"], "--rounds")])
def test_zero_prompts_is_refused_not_read_as_the_recipes(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = _stderr_lines(capsys)
    assert e.value.code == 2 and len(err) == 1 and f"{flag} must be >= 1, but got 0" in err[0], err


def test_check_takes_the_recipe_as_run_does_and_the_flag_still(tmp_path, capsys):
    empty = str(tmp_path / "empty")
    for argv in (["check", "tiny", "--run-dir", empty], ["check", "--recipe", "tiny", "--run-dir", empty]):
        assert main(argv) == 2
        assert "holds no finished stages" in _stderr_lines(capsys)[0]
    assert main(["check", "tiny", "--recipe", "tiny-cross-family"]) == 2
    assert "give one recipe" in _stderr_lines(capsys)[0]
    assert main(["check"]) == 2
    assert "give a recipe: hyco-convert check RECIPE" in _stderr_lines(capsys)[0]


def test_subcommands_are_listed_whole_recipe_first_then_in_pipeline_order():
    from hyco.config.recipe import STAGE_ORDER
    from hyco.pipeline.cli import build_parser

    parser = build_parser()
    names = list(next(a for a in parser._actions if a.dest == "command").choices)
    assert names[:3] == ["run", "plan", "recipes"]
    stages = [n for n in names if n in STAGE_ORDER]
    assert stages == [s for s in STAGE_ORDER if s in stages]
    assert names.index("smoke") == names.index("export") + 1 and names.index("project") == names.index("check") + 1


# --- help from the registries -------------------------------------------------------------------------


def test_check_help_lists_every_registered_configuration_and_workload(capsys, monkeypatch):
    from hyco.config.recipe import CheckConfig
    from hyco.data.workloads import WORKLOADS
    from hyco.runtime.configs import BRIDGE_CONFIGS, CONFIGS, NUMERICS

    text = _help(["check"], capsys, monkeypatch)
    for name in {**CONFIGS, **BRIDGE_CONFIGS}:
        assert re.search(rf"(?<![\w-]){re.escape(name)} \(", text), name
    assert all(f"NAME@{n}" in text for n in NUMERICS)
    assert all(f"{schema}: {what}" in text for schema, what in WORKLOADS.items())
    defaults = CheckConfig()
    assert f"{', '.join(defaults.configs)} where it sets none" in text
    assert f"check.prompts, {defaults.prompts} where it sets none" in text


def test_smoke_help_says_how_its_verifier_samples(capsys, monkeypatch):
    from hyco.config.recipe import CheckConfig

    text = _help(["smoke"], capsys, monkeypatch)
    assert "greedy" not in text.lower()
    assert f"temperature {CheckConfig().temperature:g}" in text and "keyed by its position" in text


def test_fixtures_help_lists_the_preset_registry(capsys, monkeypatch):
    import typing

    from hyco.config.recipe import FixturesConfig
    from hyco.fixtures.presets import PRESETS

    text = _help(["fixtures"], capsys, monkeypatch)
    listed = text.split("Presets (--preset): ", 1)[1]
    assert all(f"{name} (" in listed for name in PRESETS)
    # the recipe's choices are the registry's, so the flag's {...} cannot drift from it
    assert set(typing.get_args(typing.get_type_hints(FixturesConfig)["preset"])) == set(PRESETS)


# --- errors that point at the fix ---------------------------------------------------------------------


def test_check_on_an_empty_run_folder_names_the_stages_and_what_builds_them(tmp_path, capsys):
    assert main(["check", "tiny", "--run-dir", str(tmp_path)]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1, err
    assert f"{tmp_path} holds no finished stages: check reads fixtures/, vocab/, convert/" in err[0]
    assert "`hyco-convert run tiny` builds" in err[0] and "add convert" not in err[0]


def test_smoke_on_an_export_folder_asks_for_its_bundle(tmp_path, capsys):
    (tmp_path / "export" / "bundle").mkdir(parents=True)
    assert main(["smoke", str(tmp_path / "export"), "--verifier", str(tmp_path / "v")]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].endswith(f"did you mean {tmp_path / 'export' / 'bundle'}?"), err


@pytest.mark.parametrize("override, message", [
    ("check.runs=abc", "--set check.runs=abc: check.runs must be an integer, but got 'abc'"),
    ("check.runs=0", "--set check.runs=0: check.runs must be >= 1, but got 0"),
    ("check.runz=1", "--set check.runz=1: check: unknown key 'runz'"),
])
def test_a_bad_override_is_blamed_on_the_override_not_the_file(override, message, capsys):
    for command in ("check", "plan"):
        assert main([command, "tiny", "--set", override]) == 2
        err = _stderr_lines(capsys)
        assert len(err) == 1 and message in err[0] and "tiny.yaml" not in err[0], err


def test_a_bad_file_is_still_blamed_on_the_file(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: r\nout: o\nstages: [vocab]\ncheck: {runs: 0}\n")
    assert main(["plan", str(recipe), "--set", "check.prompts=3"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and f"{recipe}.check: check.runs must be >= 1" in err[0], err
