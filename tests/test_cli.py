"""The CLI: every subcommand explains itself; bad input is one line on stderr and exit 2."""

import subprocess
import sys

import pytest

from hyco.cli import build_parser, main
from hyco.stages import STAGES


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_every_stage_has_a_subcommand():
    names = _subcommands()
    assert "run" in names
    # `check` is runtime_check's subcommand; every other stage's subcommand is its own name
    for stage in STAGES:
        assert stage in names


@pytest.mark.parametrize("command", _subcommands())
def test_subcommand_help_documents_every_option(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help text"
            assert action.option_strings[0] in text


def test_every_stage_with_a_proof_takes_the_one_failure_flag():
    """A stage whose proof can fail keeps its artifacts, marked, under one flag name everywhere."""
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("run", "convert", "qat", "calibrate", "export"):
        flags = {o for a in choices[command]._actions for o in a.option_strings}
        assert "--allow-parity-failure" in flags, command
        assert not {f for f in flags if f.startswith("--allow-") and f != "--allow-parity-failure"}, command


def test_every_stage_subcommand_takes_its_recipe_section_through_set():
    """Defaults live in the recipe dataclasses: a stage subcommand's flags and `--set section.key=value`
    build the same typed, checked config a recipe file's section does."""
    from hyco.errors import HycoError
    from hyco.recipe import CalibrateConfig, ExportConfig, section_config

    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("vocab", "answers", "convert", "qat", "calibrate", "export"):
        assert any("--set" in a.option_strings for a in choices[command]._actions), command
    config = section_config(CalibrateConfig(), "calibrate", ["calibrate.fidelity_seeds=1", "calibrate.sqnr_passes=2"],
                            prompts=7)
    assert (config.prompts, config.fidelity_seeds, config.sqnr_passes) == (7, 1, 2)
    assert config.eval_prompts == CalibrateConfig().eval_prompts
    assert section_config(ExportConfig(), "export", ["export.share_contexts=true"]).share_contexts is True
    for bad, message in (("qat.steps=3", "takes calibrate.KEY=VALUE"), ("calibrate.no_such_key=1", "unknown key"),
                         ("calibrate.prompts=many", "must be an integer")):
        with pytest.raises(HycoError, match=message):
            section_config(CalibrateConfig(), "calibrate", [bad])


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "hyco.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "run" in out.stdout


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_missing_recipe_is_one_line_exit_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "recipe not found" in _error_line(capsys)


def test_malformed_recipe_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nout: [\n")
    assert main(["run", str(bad)]) == 2
    assert "malformed YAML" in _error_line(capsys)
    assert not (tmp_path / "x").exists()


def test_unset_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nout: {tmp_path / 'run'}\nstages: [vocab]\nmodels:\n  tokenizer: {tmp_path / 'missing'}\n")
    assert main(["run", str(recipe)]) == 2
    line = _error_line(capsys)
    assert "missing" in line
    assert not (tmp_path / "run" / "vocab").exists()
