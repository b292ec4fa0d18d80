"""`hyco-convert`: one subcommand per stage plus `run`, which runs a recipe's stages in order.

Bad input raises HycoError; it is printed as one line and the exit status is 2. A stage whose
bit-exact or parity proof fails raises ProofFailed: one line naming the check, exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import warnings
from pathlib import Path

from hyco.errors import HycoError, ProofFailed
from hyco.launch import is_follower, refuse_launch
from hyco.stages import STAGES

# The subcommands whose prompts split over the processes of `accelerate launch` (hyco/launch.py).
SPLIT_COMMANDS = ("answers", "qat", "check")


def _cmd_run(args: argparse.Namespace) -> int:
    from hyco.pipeline import run_recipe
    from hyco.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.set or [])
    run_dir = Path(args.out) if args.out else recipe.path(recipe.out)
    report = run_recipe(recipe, run_dir, force=args.force, allow_parity_failure=args.allow_parity_failure)
    print(f"wrote {run_dir}/run_report.json and {run_dir}/run_summary.md ({report['wall_s']:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyco-convert",
        description="Turn HyCo's drafters (Gemma 4 E2B QAT SLM, gemma4_assistant MTP head) into static "
        "integer NPU graphs for QNN HTP, and validate hybrid decoding against a reference verifier.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run the stages a recipe names, in order, each into OUT/<stage>/",
                         description="Run the recipe's stages in order. Each stage writes OUT/<stage>/ with a "
                         "manifest.json; a rerun skips a stage whose manifest still matches its recipe section "
                         "and inputs.")
    run.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    run.add_argument("--out", help="output folder (default: the recipe's `out`)")
    run.add_argument("--force", action="store_true", help="rebuild every stage even if its manifest matches")
    run.add_argument("--allow-parity-failure", action="store_true",
                     help="keep a stage's artifacts although its bit-exact or parity proof failed (manifest marked, "
                     "warning printed); later stages then accept such inputs too")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set models.slm=/data/gemma-4-e2b (repeatable)")
    run.set_defaults(func=_cmd_run)
    for module in STAGES.values():
        cli = importlib.import_module(module.rsplit(".", 1)[0] + ".cli")
        cli.add_cli(sub)
    return parser


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Our own warnings about the input (a dataset cut mid-record: what was read) print as one
    line like errors do, on the terminal also while a stage's log holds fd 2; library warnings keep
    Python's format (and go to the stage's log, hyco/console.py)."""
    from hyco.console import is_ours, terminal

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
