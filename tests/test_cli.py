"""The CLI: every subcommand explains itself; bad input is one line on stderr and exit 2."""

import subprocess
import sys

import pytest

from hyco.pipeline.cli import build_parser, main
from hyco.pipeline.stages import STAGES


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
    from hyco.base.errors import HycoError
    from hyco.config.recipe import CalibrateConfig, ExportConfig, section_config

    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("vocab", "answers", "convert", "qat", "calibrate", "export"):
        assert any("--set" in a.option_strings for a in choices[command]._actions), command
    config = section_config(CalibrateConfig(), "calibrate", ["calibrate.fidelity_seeds=1", "calibrate.sqnr_passes=2"],
                            prompts=7)
    assert (config.prompts, config.fidelity_seeds, config.sqnr_passes) == (7, 1, 2)
    assert config.eval_prompts == CalibrateConfig().eval_prompts
    assert section_config(ExportConfig(), "export", ["export.slm_graphs=shared"]).slm_graphs == "shared"
    for bad, message in (("qat.steps=3", "takes calibrate.KEY=VALUE"), ("calibrate.no_such_key=1", "unknown key"),
                         ("calibrate.prompts=many", "must be an integer")):
        with pytest.raises(HycoError, match=message):
            section_config(CalibrateConfig(), "calibrate", [bad])


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "hyco.pipeline.cli", "--help"], capture_output=True, text=True)
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


STAGE_SECTIONS = {"vocab": ("vocab", "dataset"), "answers": ("answers",), "convert": ("convert",), "qat": ("qat",),
                  "calibrate": ("calibrate",), "export": ("export",), "fixtures": ("fixtures",)}


def _stage_parser(command):
    return next(a for a in build_parser()._actions if a.dest == "command").choices[command]


@pytest.mark.parametrize("command", sorted(STAGE_SECTIONS))
def test_every_scalar_recipe_key_is_a_flag_of_its_stage(command):
    """The stage CLIs are generated from the recipe dataclasses: a field added to a section is a
    flag at once, with the field's comment as its help (mappings and pairs: --set only)."""
    import dataclasses
    import typing

    from hyco.config.recipe import Recipe, field_help

    hints = typing.get_type_hints(Recipe)
    dests = {a.dest: a for a in _stage_parser(command)._actions}
    for section in STAGE_SECTIONS[command]:
        cls = next(a for a in typing.get_args(hints[section]) or [hints[section]] if a is not type(None))
        helps = field_help(cls)
        for field in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[field.name]
            if isinstance(getattr(cls(), field.name), dict) or (typing.get_origin(tp) is tuple
                                                                 and typing.get_args(tp)[-1] is not Ellipsis):
                assert field.name not in dests, (command, field.name)
                continue
            assert field.name in dests, f"{command}: recipe key {section}.{field.name} has no flag"
            assert helps.get(field.name), f"recipe key {section}.{field.name} has no comment (its flag's help)"
            assert f"recipe {section}.{field.name};" in dests[field.name].help


def _configs(argv):
    args = build_parser().parse_args(argv)
    return args.configs_of(args)


def test_flags_documented_before_the_generated_cli_still_work(tmp_path):
    paths, c = _configs(["calibrate", "--convert", "c", "--qat", "q", "--vocab", "v", "--answers", "a", "--out", "o",
                         "--calibration", "percentile", "--percentile", "99.5", "--no-htp-check", "--prompts", "7"])
    assert (c["calibrate"].activation_calibration, c["calibrate"].activation_percentile) == ("percentile", 99.5)
    assert (c["calibrate"].htp_check, c["calibrate"].prompts) == (False, 7)
    assert set(paths) == {"convert", "qat", "vocab", "answers", "out"}
    _, c = _configs(["vocab", "--tokenizer", "t", "--out", "o", "--size", "9", "--scripts", "hangul,latin",
                     "--dataset", "corpus.jsonl", "--schema", "sharegpt", "--keep-placeholders"])
    assert (c["vocab"].size, c["vocab"].always_scripts, c["vocab"].keep_placeholders) == (9, ("hangul", "latin"), True)
    assert (c["dataset"].source, c["dataset"].schema) == ("corpus.jsonl", "sharegpt")
    assert _configs(["vocab", "--tokenizer", "t", "--out", "o", "--scripts", ""])[1]["vocab"].always_scripts == ()
    paths, c = _configs(["convert", "--checkpoint", "ck", "--out", "o", "--no-parity", "--float-linear-bits", "none",
                         "--rows", "9", "--set", "convert.topk=4"])
    assert (c["convert"].parity, c["convert"].float_linear_bits, c["convert"].rows, c["convert"].topk) == (False, None, 9, 4)
    assert "keep_set" not in paths
    _, c = _configs(["qat", *sum(([f"--{k}", k] for k in ("verifier", "assistant", "tokenizer", "vocab", "answers")), []),
                     "--out", "o", "--bf16-autocast", "--lr", "2e-5", "--capture-point", "before_norm"])
    assert (c["qat"].bf16_autocast, c["qat"].lr, c["qat"].capture_point) == (True, 2e-5, "before_norm")
    _, c = _configs(["export", "--calibrate", "c", "--out", "o", "--slm-graphs", "separate", "--htp-arch", "none"])
    assert (c["export"].slm_graphs, c["export"].htp_arch) == ("separate", None)


@pytest.mark.parametrize("argv, message", [
    (["convert", "--checkpoint", "ck", "--out", "o", "--rows", "many"], "convert.rows must be an integer"),
    (["convert", "--checkpoint", "ck", "--out", "o", "--float-linear-bits", "3"], "float_linear_bits must be 2, 4, 8"),
    (["qat", "--verifier", "v", "--assistant", "a", "--tokenizer", "t", "--vocab", "v", "--answers", "a", "--out", "o",
      "--steps", "-1"], "qat.steps must be >= 0"),
    (["vocab", "--tokenizer", "t", "--out", "o", "--comparison-sizes", "10,x"], "comparison_sizes[1] must be an integer"),
])
def test_a_bad_flag_value_is_one_line_naming_the_recipe_key(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_every_recipe_field_has_its_comment():
    """A field's comment is its flag's help and the recipe reader's documentation: one text."""
    import dataclasses

    from hyco.config.recipe import CheckConfig, TimingConfig, WorkloadConfig, field_help

    assert field_help(TimingConfig)["phone_bandwidth_gbs"].startswith("The weight floor's memory bandwidth")
    assert field_help(CheckConfig)["chain_depth"] == "K"
    assert "sweep_contexts" in field_help(TimingConfig) and not field_help(WorkloadConfig).get("schema")
    assert {f.name for f in dataclasses.fields(CheckConfig)} >= set(field_help(CheckConfig))


def test_the_cli_runs_offline_before_any_hub_library_is_imported():
    """huggingface_hub reads HF_HUB_OFFLINE once, at import: the CLI sets it (and datasets') before
    anything imports them, so a command never retries the network; a user's own setting wins.
    Listing recipes (like --help and --version) imports no torch: it answers in a fraction of a second."""
    import os
    import subprocess
    import sys

    probe = ("import sys; from hyco.pipeline.cli import main; main(['recipes']); print('torch' in sys.modules); "
             "import huggingface_hub.constants as c, datasets.config as d; "
             "print(c.HF_HUB_OFFLINE, d.HF_DATASETS_OFFLINE)")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"HF_DATASETS_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["False", "True False"]  # set by the CLI; the user's 0 kept
