"""No function in the project takes more than ten parameters: arguments that travel together are
one object (the check's `CheckInputs` and `Models`, export's `ExportInputs`, calibrate's
`SlmQuantization`, project's `WhatIf`, or the recipe section they come from), so adding an input
touches one place. Read from the source with `ast`, over every folder pyproject maps into the
namespace, bench/ and tests/.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 10


def project_files() -> list[Path]:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {ROOT / folder for folder in mapping.values()} | {ROOT / "bench", ROOT / "tests"}
    return sorted(p for folder in folders for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Every parameter a caller can pass (a method's self / cls aside; *args and **kwargs one each)."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def crowded(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(parameters(node)) > MAX_PARAMETERS:
                found.append(f"{path.relative_to(path.parents[1])}:{node.lineno} {node.name} ({len(parameters(node))})")
    return found


def test_no_function_takes_more_than_ten_parameters():
    files = project_files()
    assert len(files) > 100 and ROOT / "runtime_check" / "check.py" in files and ROOT / "hyco" / "base" / "files.py" in files
    assert crowded(files) == []


def test_the_rule_sees_a_crowded_function_wherever_its_parameters_are(tmp_path):
    source = tmp_path / "pkg" / "crowded.py"
    source.parent.mkdir()
    source.write_text(
        "def ten(a, b, c, d, e, /, f, g, *, h, i, j):\n    pass\n\n"
        "def eleven(a, b, c, d, e, f, g, h, *rest, i, **more):\n    pass\n\n"
        "class Step:\n"
        "    def forward(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n\n"
        "    async def gather(self, a, b, c, d, e, f, g, h, i, j, k):\n        pass\n")
    assert crowded([source]) == ["pkg/crowded.py:4 eleven (11)", "pkg/crowded.py:11 gather (11)"]
