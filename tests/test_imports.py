"""The import boundaries: pyproject's [tool.importlinter] contract (stage folders never import each
other; the core, hyco/, never imports a stage; the core's rooms import only the rooms under them;
every module under hyco/ sits in a declared layer), run with import-linter on the installed
namespace.

grimp (import-linter's graph) reads the `hyco` package from disk and does not follow setuptools'
`package-dir` mapping of the editable install, so the contract runs on a shadow tree laid out as
the namespace is: hyco/ with each stage folder copied to hyco/<name>/, as pyproject maps them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def shadow_tree(into: Path) -> Path:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        target = into.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "shipped", "*.pyc"))
    return into


def lint(tree: Path) -> subprocess.CompletedProcess:
    # run from the shadow tree (import-linter puts the working directory first on sys.path)
    return subprocess.run([str(LINT), str(ROOT / "pyproject.toml")], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_the_import_contract_holds(tmp_path):
    done = lint(shadow_tree(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_the_import_contract_breaks_on_a_cross_stage_import_an_upward_import_or_an_unplaced_module(tmp_path):
    """The contract bites: each change alone breaks it, naming the offending import or module."""
    cases = {
        "calibrate imports qat": ("hyco/calibrate/drive.py", "\nfrom hyco.qat import stage as _qat_stage\n",
                                  "hyco.calibrate.drive -> hyco.qat.stage"),
        "the fixtures import the answers stage": ("hyco/fixtures/distill.py", "\nfrom hyco.answers import generate\n",
                                                  "hyco.fixtures.distill -> hyco.answers.generate"),
        "a format imports an NPU block": ("hyco/formats/gemma_quant.py", "\nfrom hyco.npu import ops\n",
                                          "hyco.formats.gemma_quant -> hyco.npu.ops"),
        "base imports the pipeline": ("hyco/base/workers.py", "\nimport hyco.pipeline.artifacts\n",
                                      "hyco.base.workers -> hyco.pipeline.artifacts"),
        "the runtime imports the pipeline": ("hyco/runtime/tree.py", "\nfrom hyco.pipeline import verdict\n",
                                             "hyco.runtime.tree -> hyco.pipeline.verdict"),
        "the core imports a stage": ("hyco/npu/io_spec.py", "\nimport hyco.export.stage\n",
                                     "hyco.npu.io_spec -> hyco.export.stage"),
        "a module in no layer": ("hyco/new_helper.py", '"""A core module nobody placed."""\n', "new_helper"),
    }
    for name, (path, text, expected) in cases.items():
        tree = shadow_tree(tmp_path / name.replace(" ", "-"))
        with open(tree / path, "a") as f:
            f.write(text)
        done = lint(tree)
        assert done.returncode != 0, f"{name}: the contract was kept"
        assert expected in done.stdout, f"{name}:\n{done.stdout[-3000:]}"
