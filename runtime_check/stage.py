"""The check stage in the pipeline: `run_check` over the recipe's models and the vocab stage's
keep set and reserved evaluation prompts (when the recipe runs vocab).

The phone's shapes come from the sections that build the graphs: the SLM Drafter's rings and
prefill limit from `convert`, the MTP Drafter's window and capture point from `qat`. They are
part of this stage's section, so changing them there reruns the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError
from hyco.config.recipe import Recipe, to_dict
from hyco.pipeline.stages import stage_dir


def phone_shapes(recipe: Recipe) -> dict[str, Any]:
    """The phone's shapes (`PhoneShapes`' fields), from the convert and qat sections."""
    return {"ring_full": recipe.convert.ring_full, "ring_sliding": recipe.convert.ring_sliding,
            "max_prompt": recipe.convert.max_prompt, "mtp_window": recipe.qat.window,
            "capture_point": recipe.qat.capture_point}


# How a file workload's subset is picked: a check folder picked another way is not reused
SUBSET_RULE = "even over categories, seeded"


def section(recipe: Recipe) -> dict[str, Any]:
    return {"check": to_dict(recipe.check), "dataset": to_dict(recipe.dataset), "phone": phone_shapes(recipe),
            "placement": to_dict(recipe.placement), "subset": SUBSET_RULE}


def bridged(recipe: Recipe) -> bool:
    """A verifier of another family: the check drafts for it through the token bridge."""
    return recipe.models.verifier_tokenizer is not None


def inputs(recipe: Recipe, run_dir: Path) -> dict[str, Path]:
    paths = {}
    names = ["tokenizer", "verifier", "slm"]
    if not bridged(recipe):
        names.append("assistant")
    else:  # the verifier's own head runs only in Cloud+head (cloud-mtp), where the recipe names one
        names.append("verifier_tokenizer")
        if any(n.partition("@")[0] == "cloud-mtp" for n in recipe.check.configs):
            names.append("assistant")
    for name in names:
        path = recipe.path(getattr(recipe.models, name), run_dir)
        if path is None:
            raise HycoError(f"models.{name} must name a folder for the check stage, but got null")
        paths[name] = path
    if "vocab" in recipe.stages:
        paths["vocab"] = stage_dir(run_dir, "vocab")
    if recipe.check.workload.source is not None:
        paths["workload"] = recipe.path(recipe.check.workload.source, run_dir)
    if recipe.check.backend == "qnn":  # both drafters read the export bundle (graphs, LUTs, rope, io_spec)
        paths["convert"] = paths["qat"] = stage_dir(run_dir, "export") / "bundle"
    if recipe.check.backend == "onnxruntime":
        from hyco.runtime.configs import decode_config

        numerics = {decode_config(n, recipe.check, bridged=bridged(recipe)).drafters for n in recipe.check.configs}
        if "float" in numerics:
            paths["convert"] = stage_dir(run_dir, "convert")
            paths["qat"] = stage_dir(run_dir, "qat")
        if "deployed" in numerics:
            paths["bundle"] = stage_dir(run_dir, "export") / "bundle"
    return paths


def check_inputs(recipe: Recipe, run_dir: Path):
    """`run_check`'s inputs (`CheckInputs`) from the recipe and the run folder."""
    from hyco.runtime_check.check import CheckInputs, PhoneShapes

    paths = inputs(recipe, run_dir)
    return CheckInputs(verifier=paths["verifier"], slm=paths["slm"], tokenizer=paths["tokenizer"],
                       phone=PhoneShapes(**phone_shapes(recipe)), dataset=recipe.dataset,
                       assistant=paths.get("assistant"), verifier_tokenizer=paths.get("verifier_tokenizer"),
                       vocab_dir=paths.get("vocab"), convert_dir=paths.get("convert"), qat_dir=paths.get("qat"),
                       bundle_dir=paths.get("bundle"), workload=paths.get("workload"), placement=recipe.placement)


def build(recipe: Recipe, run_dir: Path, out: Path | None, *, configs: list[str] | None = None,
          prompts: int | None = None) -> dict[str, Any]:
    from hyco.runtime_check.check import run_check

    check = check_inputs(recipe, run_dir)
    if recipe.check.backend == "qnn" and (check.convert_dir / "bundle.json").is_file():
        # a bundle built for another SoC than the recipe's is refused (run_check says when there is none)
        from hyco.qnn.bundle import verify_bundle

        verify_bundle(check.convert_dir, recipe.export.soc_model)
    return run_check(check, recipe.check, out, configs=configs, prompts=prompts)
