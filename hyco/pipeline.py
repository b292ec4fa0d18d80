"""`hyco-convert run`: the recipe's stages in order, each into RUN_DIR/<stage>/."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from hyco.artifacts import folder_lock, markdown_table, peak_rss_mb, remove_stale_temps, run_stage, write_json
from hyco.preflight import run_preflight
from hyco.recipe import Recipe
from hyco.stages import load_stage, stage_dir, stage_section


def run_recipe(recipe: Recipe, run_dir: Path, *, force: bool = False, allow_parity_failure: bool = False,
               log=print) -> dict[str, Any]:
    """Each stage in order; a stage whose proof fails raises ProofFailed, so `run` stops there
    (unless `allow_parity_failure` or the recipe's key keeps its artifacts, marked)."""
    run_dir = Path(run_dir)  # created by the first stage that finishes: a refused input leaves no OUT
    modules = {name: load_stage(name) for name in recipe.stages}  # fail before any work
    allow = allow_parity_failure or recipe.allow_parity_failure
    recipe = dataclasses.replace(recipe, allow_parity_failure=allow)  # the stages' build() reads it
    # The user's own inputs (checkpoints, tokenizers, the corpus) are checked, and every stage's
    # memory and disk estimated, before any stage runs: a truncated verifier shard or a machine too
    # small for qat fails the run now, not after hours of earlier stages.
    run_preflight(recipe, modules, run_dir, log)
    with folder_lock(run_dir):
        return _run_stages(recipe, modules, run_dir, force, allow, log)


def _run_stages(recipe: Recipe, modules: dict, run_dir: Path, force: bool, allow: bool, log) -> dict[str, Any]:
    rows = []
    start = time.perf_counter()
    for name, module in modules.items():
        inputs = module.inputs(recipe, run_dir)
        log(f"[{name}] -> {stage_dir(run_dir, name)}")
        manifest = run_stage(
            name,
            stage_dir(run_dir, name),
            stage_section(module, name, recipe),
            inputs,
            lambda tmp, module=module: module.build(recipe, run_dir, tmp),
            force=force,
            allow_parity_failure=allow,
        )
        status = "skipped (manifest matches)" if manifest["skipped"] else "built"
        when = "built earlier in " if manifest["skipped"] else ""
        messages = manifest.get("log", {})
        said = (f"; {messages['lines']} lines of library output in {stage_dir(run_dir, name) / messages['file']}"
                if messages.get("lines") else "")
        log(f"[{name}] {status}: {len(manifest['outputs'])} files, {when}{manifest['wall_s']:.1f} s, "
            f"peak RSS {manifest['peak_rss_mb']:.0f} MiB{said}")
        if manifest.get("proof_failed"):
            log(f"[{name}] WARNING: kept although its proof failed ({manifest['proof_failed']}); manifest marked")
        rows.append({
            "stage": name,
            "status": status,
            "files": len(manifest["outputs"]),
            "bytes": sum(o["bytes"] for o in manifest["outputs"].values()),
            "wall_s": manifest["wall_s"],
            "peak_rss_mb": manifest["peak_rss_mb"],
            "library_warnings": messages.get("warnings", 0),
            "library_lines": messages.get("lines", 0),
            "summary": manifest.get("summary", {}),
        })
    report = {
        "recipe": recipe.name,
        "run_dir": str(run_dir),
        "stages": rows,
        "wall_s": round(time.perf_counter() - start, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(run_dir)  # a half-written run report of a killed run
    write_json(run_dir / "run_report.json", report)
    md = f"# Run of recipe `{recipe.name}`\n\nOutput: `{run_dir}`; total {report['wall_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MiB.\n\n"
    md += markdown_table(rows, ["stage", "status", "files", "bytes", "wall_s", "peak_rss_mb", "library_warnings",
                                "library_lines"])
    md += "\nlibrary_warnings / library_lines: what the libraries printed, in each stage's `stage.log`.\n"
    (run_dir / "run_summary.md").write_text(md)
    return report
