"""The README as a user meets it: every hyco-convert command it shows parses with the CLI as built,
every subcommand it names exists (its --help prints), every file it links or names exists, it
stays a guide (at most ~250 lines, no project history), and its command table lists every
subcommand."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hyco.pipeline.cli import build_parser, main

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def commands() -> list[list[str]]:
    """The argument lists of every runnable `hyco-convert` line in the README (its indented code,
    continuation lines joined) and of every inline `hyco-convert ...` span; `# ...` comments and
    the `--set ...` placeholder dropped."""
    text = README.replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith("    ") and "hyco-convert " in line]
    lines += re.findall(r"`(hyco-convert [^`]+)`", text)
    out = []
    for line in lines:
        line = line.split(" #", 1)[0].replace("--set ...", "")
        argv = shlex.split(line.split("hyco-convert ", 1)[1])
        if not argv[0].isupper():  # `hyco-convert COMMAND --help` is a pattern, not a command
            out.append(argv)
    return out


def test_every_command_in_a_code_block_parses():
    found = commands()
    assert len(found) >= 3, found
    parser = build_parser()
    for argv in found:
        args = parser.parse_args(argv)
        assert args.command == argv[0]


def test_every_subcommand_the_readme_names_prints_its_help(capsys):
    named = set(re.findall(r"^\| `(\w[\w-]*)[ `]", README.split("## Commands", 1)[1].split("\n## ", 1)[0], re.M))
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    assert named == subcommands, (named ^ subcommands)
    for name in sorted(named):
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        assert "usage: hyco-convert " + name in capsys.readouterr().out


def test_every_file_the_readme_links_or_names_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    named = re.findall(r"`((?:docs|recipes|tests|bench|\.ci)/[\w./-]*)`", README)
    assert links and named
    for path in links + named:
        assert (ROOT / path).exists(), path


def test_the_readme_is_a_guide_not_a_notebook():
    assert len(README.splitlines()) <= 250
    for history in (r"\bissue \d+", r"\b(this|last|an earlier) stop\b", r"\bat [0-9a-f]{7}\b", r"\bbefore [0-9a-f]{7}\b"):
        assert not re.search(history, README, re.I), history
    assert "arXiv 2610.21436" in README
    for heading in ("## Install", "## Run the embedded default", "## Run your own checkpoints", "## Commands",
                    "## What a run writes", "## Troubleshooting", "## Glossary"):
        assert heading in README, heading
