"""The stage registry: stage name -> the module that implements it.

A stage module exposes three functions (imports of heavy libraries stay inside them, so the
CLI starts fast):
- `inputs(recipe, run_dir) -> dict[str, Path]`: what the stage reads, fingerprinted for reruns;
- `build(recipe, run_dir, out) -> dict | None`: write the stage's artifacts into `out`
  (a temp folder renamed into place afterwards); the returned summary lands in the manifest;
- `add_cli(subparsers)`: the stage's own subcommand, a thin wrapper over its
  keyword-only library function.
and may expose `section(recipe) -> dict`, the recipe data whose change reruns the stage
(default: the stage's own section).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from hyco.base.errors import HycoError
from hyco.config.recipe import STAGE_ORDER, Recipe

STAGES: dict[str, str] = {
    "fixtures": "hyco.fixtures.stage",
    "vocab": "hyco.vocab.stage",
    "answers": "hyco.answers.stage",
    "convert": "hyco.convert.stage",
    "qat": "hyco.qat.stage",
    "export": "hyco.export.stage",  # its cli.py also adds `hyco-convert smoke`
    "calibrate": "hyco.calibrate.stage",
    "check": "hyco.runtime_check.stage",
}


def load_stage(name: str) -> ModuleType:
    if name not in STAGES:
        known = [s for s in STAGE_ORDER if s in STAGES]
        raise HycoError(f"stage {name!r} is not implemented in this version (implemented: {', '.join(known)})")
    return importlib.import_module(STAGES[name])


def stage_section(module: ModuleType, name: str, recipe: Recipe) -> dict[str, Any]:
    if hasattr(module, "section"):
        return module.section(recipe)
    return recipe.section(name)


def stage_dir(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / name
