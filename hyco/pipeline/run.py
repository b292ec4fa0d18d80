"""`hyco-convert run`: the recipe's stages in order, each into RUN_DIR/<stage>/."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from hyco.base.errors import ProofFailed
from hyco.base.files import write_json
from hyco.base.memory import peak_rss_mb
from hyco.config.recipe import Recipe
from hyco.pipeline import verdict
from hyco.pipeline.artifacts import folder_lock, markdown_table, remove_stale_temps, run_stage
from hyco.pipeline.preflight import run_preflight
from hyco.pipeline.stages import load_stage, stage_dir, stage_section


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
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for name, module in modules.items():
        inputs = module.inputs(recipe, run_dir)
        log(f"[{name}] -> {stage_dir(run_dir, name)}")
        try:
            manifest = run_stage(name, stage_dir(run_dir, name), stage_section(module, name, recipe), inputs,
                                 lambda tmp, module=module: module.build(recipe, run_dir, tmp),
                                 force=force, allow_parity_failure=allow)
        except ProofFailed as e:  # the summary says where the run stopped and why, then `run` stops
            write_run_summary(recipe, run_dir, rows, time.perf_counter() - start, stopped=(name, str(e)))
            raise
        rows.append(stage_row(name, run_dir, manifest, log))
    return write_run_summary(recipe, run_dir, rows, time.perf_counter() - start)


def stage_row(name: str, run_dir: Path, manifest: dict[str, Any], log) -> dict[str, Any]:
    """The stage's line on the terminal and its row in the run report, its verdict included."""
    status = "skipped (manifest matches)" if manifest["skipped"] else "built"
    when = "built earlier in " if manifest["skipped"] else ""
    messages = manifest.get("log", {})
    said = (f"; {messages['lines']} lines of library output in {stage_dir(run_dir, name) / messages['file']}"
            if messages.get("lines") else "")
    log(f"[{name}] {status}: {len(manifest['outputs'])} files, {when}{manifest['wall_s']:.1f} s, "
        f"peak RSS {manifest['peak_rss_mb']:.0f} MiB{said}")
    if manifest.get("proof_failed"):
        log(f"[{name}] WARNING: kept although its proof failed ({manifest['proof_failed']}); manifest marked")
    return {
        "stage": name,
        "status": status,
        "files": len(manifest["outputs"]),
        "bytes": sum(o["bytes"] for o in manifest["outputs"].values()),
        "wall_s": manifest["wall_s"],
        "peak_rss_mb": manifest["peak_rss_mb"],
        "library_warnings": messages.get("warnings", 0),
        "known_warnings": messages.get("known_warnings", 0),
        "library_lines": messages.get("lines", 0),
        "summary": manifest.get("summary", {}),
        "verdict": stage_verdict(stage_dir(run_dir, name)),
    }


def stage_verdict(folder: Path) -> list[dict[str, str]]:
    """The verdict lines a finished stage wrote into its report.json (none from a stage folder
    written before verdicts existed)."""
    report = folder / "report.json"
    if not report.is_file():
        return []
    return json.loads(report.read_text()).get("verdict", [])


def write_run_summary(recipe: Recipe, run_dir: Path, rows: list[dict[str, Any]], wall_s: float,
                      stopped: tuple[str, str] | None = None) -> dict[str, Any]:
    """run_report.json and run_summary.md: the verdict first (did it work, how faithful, does it
    pay off), one line per proof with its figure and threshold, then the stages' table."""
    report = {"recipe": recipe.name, "run_dir": str(run_dir), "stages": rows, "wall_s": round(wall_s, 3),
              "peak_rss_mb": round(peak_rss_mb(), 1), "stopped": None if stopped is None else
              {"stage": stopped[0], "reason": stopped[1]}}
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(run_dir)  # a half-written run report of a killed run
    write_json(run_dir / "run_report.json", report)
    (run_dir / "run_summary.md").write_text(run_summary_markdown(recipe.name, run_dir, report))
    return report


def run_summary_markdown(name: str, run_dir: Path, report: dict[str, Any]) -> str:
    lines = [(row["stage"], line) for row in report["stages"] for line in verdict.from_json(row["verdict"])]
    stopped = report["stopped"]
    word = f"FAILED at {stopped['stage']}" if stopped else verdict.overall(line for _, line in lines)
    md = [f"# Run of recipe `{name}`: {word}", ""]
    if stopped:
        md += [f"The {stopped['stage']} stage's proof failed and the run stopped there; nothing of that stage was moved "
               f"into place: {stopped['reason']}", ""]
    payoff = [line for _, line in lines if line.check.startswith("pays off")]
    if payoff:
        md += [f"Pays off: {payoff[0].figure}", ""]
    md += [line.markdown(stage) for stage, line in lines] + [""]
    md += [f"Output: `{run_dir}`; total {report['wall_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MiB. Each "
           "stage's own summary.md opens with its verdict and holds the detail.", "", "## Stages", ""]
    md += [markdown_table(report["stages"], ["stage", "status", "files", "bytes", "wall_s", "peak_rss_mb",
                                             "library_warnings", "known_warnings", "library_lines"]),
           "What the libraries printed is in each stage's `stage.log`: library_warnings counts the warnings nobody "
           "has explained; known_warnings those checked and harmless here, each marked `[known: why]` in the log "
           "(hyco/base/console.py `KNOWN_WARNINGS`).", ""]
    return "\n".join(md)
