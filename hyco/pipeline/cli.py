"""`hyco-convert`: `run`, `plan` and `recipes` over a whole recipe, then one subcommand per stage
in pipeline order.

Bad input raises HycoError; it is printed as one line and the exit status is 2 (a bad command
line too: `Parser`). A stage whose bit-exact or parity proof fails raises ProofFailed: one line
naming the check, exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import os
import re
import signal
import sys
import textwrap
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from hyco.base.errors import HycoError, ProofFailed
from hyco.base.launch import is_follower, refuse_launch
from hyco.config.recipe import STAGE_ORDER, add_set_option, field_help, section_config
from hyco.pipeline.stages import STAGES

# The subcommands whose prompts split over the processes of `accelerate launch` (hyco/base/launch.py).
SPLIT_COMMANDS = ("answers", "qat", "check")


class Formatter(argparse.HelpFormatter):
    """argparse's help layout, without breaking a name at its hyphens (hyco-server-head stays whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: what is wrong and where the help is, exit status 2
    (argparse prints the whole usage first). Every subcommand's parser is one too."""

    def __init__(self, *args: Any, formatter_class: type = Formatter, **kwargs: Any):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        # "argument --prompts: must be >= 1" reads as the recipe's own checks do: "--prompts must be >= 1"
        message = re.sub(r"^argument (\S+): (must .*)$", r"\1 \2", message)
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

    def parse_args(self, args=None, namespace=None):  # an unknown flag is the subcommand's error, not the top's
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
            commands.get(getattr(parsed, "command", None), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`, refused on the command line (a 0 must not read
    as "not given" further on)."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, but got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, but got {value}")
        return value

    return read


def add_recipe_argument(p: argparse.ArgumentParser, **kwargs: Any) -> None:
    """RECIPE: a packaged recipe's name or a YAML file (the names listed from the package)."""
    from hyco.config.recipe import packaged_recipes

    p.add_argument("recipe", metavar="RECIPE", help=f"a packaged recipe ({', '.join(packaged_recipes())}; "
                   "`hyco-convert recipes` describes them) or a recipe YAML file; a file wins over a name",
                   **kwargs)


def _cmd_run(args: argparse.Namespace) -> int:
    from hyco.config.recipe import load_recipe
    from hyco.pipeline.run import run_recipe

    recipe = load_recipe(args.recipe, args.set or [])
    run_dir = Path(args.out) if args.out else recipe.path(recipe.out)
    report = run_recipe(recipe, run_dir, force=args.force, allow_parity_failure=args.allow_parity_failure)
    print(f"wrote {run_dir}/run_report.json and {run_dir}/run_summary.md ({report['wall_s']:.1f} s)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from hyco.config.recipe import find_recipe, load_recipe
    from hyco.pipeline.preflight import inspect_run, stage_plan
    from hyco.pipeline.stages import load_stage

    recipe = load_recipe(args.recipe, args.set or [])
    run_dir = Path(args.out) if args.out else recipe.path(recipe.out)
    modules = {name: load_stage(name) for name in recipe.stages}
    print(f"plan of recipe {recipe.name} ({find_recipe(args.recipe)}) into {run_dir}:")
    for stage, action, why in stage_plan(recipe, modules, run_dir, recipe.allow_parity_failure):
        print(f"  {stage:<10} {action:<6} {why}")
    found = inspect_run(recipe, modules, run_dir)
    for row in found.estimates:
        print(row.text())
    if found.session_text(recipe.export.max_session_bytes):
        print(found.session_text(recipe.export.max_session_bytes))
    problems = found.problems + found.over_limits
    for problem in problems:  # every one, a line each: the recipe is fixed once, not once per run
        print(f"hyco-convert plan: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    print("no problems found: `hyco-convert run` with the same arguments would do the above")
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from hyco.base.loading import read_yaml
    from hyco.config.recipe import packaged_recipes

    recipes = packaged_recipes()
    width = max(map(len, recipes), default=0)
    for name, path in recipes.items():
        data = read_yaml(path, "recipe")
        description = data.get("description") if isinstance(data, dict) else None
        print(f"{name:<{width}}  {description or '(no description)'}")
    return 0


def stage_command(sub: argparse._SubParsersAction, name: str, *, help: str, description: str, run: Callable[..., int],
                  sections: dict[str, Any] | None = None, inputs: dict[str, str] | None = None,
                  optional: dict[str, str] | None = None, aliases: dict[str, str] | None = None,
                  proof: bool = False) -> argparse.ArgumentParser:
    """A stage's subcommand, built from its recipe sections: one flag per scalar field of each
    section's dataclass (`--kebab-name`, help from the field's comment in hyco/config/recipe.py, a bool as
    `--x / --no-x`, a tuple comma-separated), `--set SECTION.KEY=VALUE` for the first section, the
    stage's input folders, `--out`, `--force` and, for a stage whose proof can fail,
    `--allow-parity-failure`. `run(args, paths, **configs)` gets the sections typed and checked
    as a recipe file's are (flags over the defaults, then --set) and the folders given (`out` too).
    `aliases` keeps a field's documented older flag name (field -> "--flag")."""
    sections, inputs, optional, aliases = sections or {}, inputs or {}, optional or {}, aliases or {}
    p = sub.add_parser(name, help=help, description=description)
    for key, text in {**inputs, **optional}.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, required=key in inputs, help=text)
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    flags: dict[str, list[str]] = {}
    for section, default in sections.items():
        flags[section] = [field.name for field in config_flags(p, section, default, aliases)]
    if proof:
        p.add_argument("--allow-parity-failure", action="store_true",
                       help="keep the artifacts although the stage's proof failed (manifest marked, warning printed)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching manifest")
    first = next(iter(sections), None)
    if first:
        add_set_option(p, first)

    def configs_of(args: argparse.Namespace) -> tuple[dict[str, Path], dict[str, Any]]:
        configs = {section: section_config(default, section, args.set if section == first else (),
                                           **{k: getattr(args, k) for k in flags[section] if hasattr(args, k)})
                   for section, default in sections.items()}
        paths = {k: Path(getattr(args, k)) for k in [*inputs, *optional, "out"] if getattr(args, k) is not None}
        return paths, configs

    def command(args: argparse.Namespace) -> int:
        paths, configs = configs_of(args)
        return run(args, paths, **configs)

    p.set_defaults(func=command, configs_of=configs_of)
    return p


NOT_GIVEN = argparse.SUPPRESS  # a flag not given leaves the recipe's value (which may be null)


def config_flags(p: argparse.ArgumentParser, section: str, default: Any, aliases: dict[str, str]) -> list:
    """One flag per scalar field of a recipe section (mappings and nested sections: --set only)."""
    hints, helps = typing.get_type_hints(type(default)), field_help(type(default))
    added = []
    for field in dataclasses.fields(default):
        tp, value = hints[field.name], getattr(default, field.name)
        if dataclasses.is_dataclass(tp) or isinstance(value, dict) or _is_pair(tp):
            continue
        name = aliases.get(field.name, f"--{field.name.replace('_', '-')}")
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        text = f"{helps.get(field.name) or 'recipe key'} (recipe {section}.{field.name}; default: {shown})"
        text = text.replace("%", "%%")
        if tp is bool:
            p.add_argument(name, dest=field.name, action=argparse.BooleanOptionalAction, default=NOT_GIVEN, help=text)
        else:  # a Literal's choices are checked by the recipe (one line, as for a recipe file), listed here
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices else field.name.upper()
            p.add_argument(name, dest=field.name, type=_flag_value(tp), default=NOT_GIVEN, metavar=metavar, help=text)
        added.append(field)
    return added


def _is_pair(tp: Any) -> bool:  # a fixed-length tuple such as qat.betas: --set only
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and not (len(args) == 2 and args[1] is Ellipsis)


def _flag_value(tp: Any) -> Callable[[str], Any]:
    """A flag's text as a recipe value, typed and checked later by the recipe's own rules (so a
    bad value is the same one-line error as in a recipe file): a tuple comma-separated, `none` /
    `null` for an optional field, a number as Python reads it (YAML 1.1 reads 2e-5 as text)."""
    if typing.get_origin(tp) is tuple:
        item = _flag_value(typing.get_args(tp)[0])
        return lambda text: [item(part.strip()) for part in text.split(",") if part.strip()]
    inner = [a for a in typing.get_args(tp) if a is not type(None)] if type(None) in typing.get_args(tp) else [tp]

    def read(text: str) -> Any:
        if len(inner) < 2 and tp is not inner[0] and text.lower() in ("none", "null"):
            return None
        for number in (int, float):
            if inner[0] is number or typing.get_origin(inner[0]) is Literal:
                with contextlib.suppress(ValueError):
                    return number(text)
        return text

    return read


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    stages = [s for s in STAGE_ORDER if s in STAGES]
    parser = Parser(
        prog="hyco-convert",
        description="Turn HyCo's drafters (Gemma 4 E2B QAT SLM, gemma4_assistant MTP head) into static "
        "integer NPU graphs for QNN HTP, and validate hybrid decoding against a reference verifier. Commands: "
        "run, plan and recipes work on a whole recipe; the others run one stage each, in pipeline order ("
        f"{', '.join(stages)}), with smoke after export and project after check.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('hyco-convert')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    run = sub.add_parser("run", help="run the stages a recipe names, in order, each into OUT/<stage>/",
                         description="Run the recipe's stages in order. Each stage writes OUT/<stage>/ with a "
                         "manifest.json; a rerun skips a stage whose manifest still matches its recipe section "
                         "and inputs. Relative paths in the recipe are the working directory's.")
    add_recipe_argument(run)
    run.add_argument("--out", help="output folder (default: the recipe's `out`)")
    run.add_argument("--force", action="store_true", help="rebuild every stage even if its manifest matches")
    run.add_argument("--allow-parity-failure", action="store_true",
                     help="keep a stage's artifacts although its bit-exact or parity proof failed (manifest marked, "
                     "warning printed); later stages then accept such inputs too")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set models.slm=/data/gemma-4-e2b (repeatable)")
    run.set_defaults(func=_cmd_run)
    plan = sub.add_parser("plan", help="validate a recipe without running it: problems, stages to build or reuse, "
                          "estimates",
                          description="What `run` would do, without running a stage: each stage built or reused "
                          "(its folder's manifest matches its recipe section and inputs), every problem with the "
                          "recipe's inputs at once (a line each on stderr, exit status 2), and preflight's memory "
                          "and disk estimate per stage.")
    add_recipe_argument(plan)
    plan.add_argument("--out", help="output folder (default: the recipe's `out`)")
    plan.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a recipe value, as for run (repeatable)")
    plan.set_defaults(func=_cmd_plan)
    recipes = sub.add_parser("recipes", help="list the recipes shipped with the package",
                             description="List the packaged recipes, a line each: the name `run`, `plan` and "
                             "`check` accept, and what the recipe is for.")
    recipes.set_defaults(func=_cmd_recipes)
    for module in dict.fromkeys(STAGES[s].rsplit(".", 1)[0] for s in stages):
        importlib.import_module(module + ".cli").add_cli(sub)
    return parser


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Our own warnings about the input (a dataset cut mid-record: what was read) print as one
    line like errors do, on the terminal also while a stage's log holds fd 2; library warnings keep
    Python's format (and go to the stage's log, hyco/base/console.py)."""
    from hyco.base.console import is_ours, terminal

    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if is_ours(category):
            print(f"hyco-convert {command}: warning: {message}", file=terminal())
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so every `finally` and `atomic_dir` cleans up as
    for Ctrl-C (Python's default for SIGTERM is to die on the spot, leaving temp folders)."""

    signum = signal.SIGTERM


def _terminate(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    # No hub is reached at run time (every recipe reads local folders). huggingface_hub and datasets
    # read these once, at import: set before anything imports them, a dataset source is read from
    # its files or the local cache without ~20 s of network retries first. The user's own setting wins.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with _one_line_warnings(args.command):
            if args.command not in SPLIT_COMMANDS:
                refuse_launch(args.command)
            return args.func(args) or 0
    except HycoError as e:
        print(f"hyco-convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ProofFailed as e:
        print(f"hyco-convert {args.command}: proof failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if is_follower():  # stopped by the launcher because another process ended: that one says why
            return 128 + int(signum)
        print(f"hyco-convert {args.command}: interrupted ({signal.Signals(signum).name}); no partial artifact was kept",
              file=sys.stderr)
        return 128 + int(signum)
    except Exception as e:
        error = disk_error(e)
        if error is None:
            raise
        print(f"hyco-convert {args.command}: error: {error}; nothing was moved into place", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted"}


def disk_error(e: BaseException) -> str | None:
    """One line for an exception caused by the output's filesystem (full, read-only, not ours to
    write), found in its chain of causes: libraries wrap the OSError (onnx, safetensors and
    onnxruntime raise their own types with the OS's message inside); None for anything else."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return f"{e.filename}: {DISK_ERRNOS[e.errno]}" if e.filename else DISK_ERRNOS[e.errno]
        text = str(e)
        for code, what in DISK_ERRNOS.items():
            if code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) and os.strerror(code).lower() in text.lower():
                return f"{what} ({text.splitlines()[0][:200]})"
        e = e.__cause__ or e.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
