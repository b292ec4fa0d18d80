"""Preflight of `run`, before its first stage: every model folder the recipe names checked for its
role's layout (config, index, shard headers, the tensors the stages read), the chat corpus found,
and each stage's memory, disk and device estimated, printed, and held to the recipe's `limits`.
A machine that cannot hold a stage is told so in one line naming the stage and the figure, before
hours of earlier stages are spent.

The estimates come from the checkpoints' own bytes (safetensors headers, no tensor read), with the
factors each stage was measured to need (README, full-size dry run); they are the order of a stage's
peak, not a promise.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyco.base.errors import HycoError

GiB = 1024**3

# Per model role: its quantization (the SLM's: one of its family's SLM formats, hyco/config/families.py)
# and the tensors every stage that reads it needs; its model type is a registered family's.
ROLES: dict[str, dict[str, Any]] = {
    "slm": {"quant_method": "family", "tensors": ("embed_tokens.", "layers.0.self_attn.q_proj.weight")},
    "verifier": {"quant_method": None, "tensors": ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight")},
    "assistant": {"quant_method": None, "tensors": ("layers.0.",)},
}

# Peak memory of a stage as a multiple of the bytes of the model it loads, as loaded: the verifier
# at its checkpoint's width (bench/bench_verifier.py: 1.14-1.17x in BF16 on the CPU, with the
# interpreter and the answers' caches) and twice that when a BF16 checkpoint is loaded in fp32
# (`load_growth`); qat holds the verifier then the head and its students, calibrate and export
# the quantized graphs and onnxruntime's / QNN's working copies.
MEMORY = {"answers": ("verifier", 1.2), "qat": ("verifier", 1.3), "check": ("verifier", 1.2),
          "convert": ("slm", 1.2), "calibrate": ("slm", 3.5), "export": ("slm", 4.0)}
DISK = {"answers": ("verifier", 0.0), "qat": ("assistant", 2.0), "check": ("verifier", 0.0),
        "convert": ("slm", 2.2), "calibrate": ("slm", 3.0), "export": ("slm", 4.0)}


@dataclass(frozen=True)
class Estimate:
    stage: str
    memory_gb: float
    disk_gb: float
    device: str
    basis: str = "estimated"  # or why there is no figure: no model loaded, or one an earlier stage makes

    def text(self) -> str:
        if self.basis != "estimated":
            return f"[preflight] {self.stage}: {self.basis}, on {self.device}"
        return (f"[preflight] {self.stage}: ~{size_text(self.memory_gb)} memory, ~{size_text(self.disk_gb)} disk, "
                f"on {self.device}")


def checkpoint_bytes(folder: Path) -> int:
    from hyco.base.loading import checkpoint_files

    tensors = checkpoint_files(folder, folder.name)
    return sum(p.stat().st_size for p in {path for _, _, path in tensors.values()})


def check_model(role: str, folder: Path, family: str | None = None, *, cross_family: bool = False) -> int:
    """`folder` laid out as the `role` needs: a registered family's model type (`family`: the
    recipe's models.family, which it must then be) and quantization method, index and shard
    headers whole, the tensors the stages read present. `cross_family`: a verifier of another
    family, drafted for through the token bridge (models.verifier_tokenizer): any decoder
    transformers loads, no family asked. Returns its weight bytes."""
    from hyco.base.loading import checkpoint_files, config_quant_method, read_json
    from hyco.config.families import family_of, head_of

    if not folder.is_dir():
        raise HycoError(f"models.{role}: {folder} not found")
    config = read_json(folder / "config.json", f"{role} config.json")
    want = ROLES[role]
    where = f"{folder / 'config.json'} (models.{role})"
    if cross_family:
        found = None
    else:
        found = head_of(config, where)[0] if role == "assistant" else family_of(config, where)
    if found is not None and family is not None and found.name != family:
        raise HycoError(f"{where}: a {found.name} checkpoint, but models.family is {family!r}")
    method = config_quant_method(config)
    if want["quant_method"] == "family" and method not in found.slm_formats:
        raise HycoError(f"{folder / 'config.json'}: models.{role} must be in the QAT mobile format (quant_method "
                        f"{' or '.join(map(repr, found.slm_formats))}), but got {method!r}")
    if role == "verifier" and method is not None:  # a server's AWQ / GPTQ / compressed-tensors checkpoint
        from hyco.base.loading import check_server_quant

        check_server_quant(folder, method, "models.verifier")
    elif want["quant_method"] is None and method is not None:
        raise HycoError(f"{folder / 'config.json'}: models.{role} must be a float checkpoint, but it is quantized "
                        f"(quant_method {method!r})")
    names = checkpoint_files(folder, role)
    for needed in want["tensors"]:
        if not any(needed in n for n in names):
            raise HycoError(f"{folder}: models.{role} has no tensor named like {needed!r} (another layout?)")
    return sum(p.stat().st_size for p in {path for _, _, path in names.values()})


def check_teacher(verifier: Path, quantized_teacher: bool) -> None:
    """qat distills the MTP head against the verifier's states: a BF16 teacher unless the recipe
    opts in to a quantized one (qat.quantized_teacher)."""
    from hyco.base.loading import quant_method

    method = quant_method(verifier, "verifier")
    if method is not None and not quantized_teacher:
        raise HycoError(f"{verifier / 'config.json'}: models.verifier is quantized ({method!r}), and qat distills the "
                        "MTP head against its states: point models.verifier at the BF16 checkpoint for qat (and set "
                        "it back for check), or set qat.quantized_teacher: true")


def check_corpus(recipe) -> None:
    """The chat corpus the vocab stage counts: its first conversation can be read."""
    from hyco.data.chat import iter_conversations

    source = recipe.dataset
    try:
        next(iter(iter_conversations(source.source, source.schema, source.split)))
    except StopIteration:
        raise HycoError(f"dataset.source {source.source!r}: no conversations in split {source.split!r}") from None


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
    return f"CPU ({os.cpu_count()} cores)"


def load_growth(stage: str, placement, checkpoint_dtype: str | None) -> float:
    """How much larger the verifier is in memory than on disk in `stage`: 2 when a 16-bit
    checkpoint is loaded in fp32 (answers, qat and check as `placement.dtype` says, auto meaning
    fp32 without a GPU), else 1."""
    import torch

    if checkpoint_dtype not in ("bfloat16", "float16"):
        return 1.0
    fp32 = placement.dtype == "float32" or (placement.dtype == "auto" and not torch.cuda.is_available())
    return 2.0 if fp32 else 1.0


def estimate(stages: tuple[str, ...], sizes: dict[str, int], growth: dict[str, float] | None = None,
             unreadable: set[str] = frozenset()) -> list[Estimate]:
    """`growth`: per stage, the verifier's `load_growth`; `unreadable`: the roles whose model
    folder preflight refused (no figure, said so)."""
    where = device()
    rows = []
    for stage in stages:
        mem_role, mem_factor = MEMORY.get(stage, (None, 0.0))
        disk_role, disk_factor = DISK.get(stage, (None, 0.0))
        if mem_role == "verifier":
            mem_factor *= (growth or {}).get(stage, 1.0)
        memory = mem_factor * sizes.get(mem_role, 0) / GiB
        disk = disk_factor * sizes.get(disk_role, 0) / GiB
        onnx = stage in ("convert", "calibrate", "export")
        basis = ("estimated" if mem_role in sizes else "loads no model" if mem_role is None
                 else f"not estimated (its {mem_role} could not be read)" if mem_role in unreadable
                 else f"not estimated (its {mem_role} is made by an earlier stage of this run)")
        rows.append(Estimate(stage, memory, disk, "CPU (onnxruntime, QNN)" if onnx else where, basis))
    return rows


def machine_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


@dataclass
class Findings:
    """What `inspect_run` found: the problems with the recipe's inputs (each one line), each
    stage's estimate, and the estimates over the recipe's limits (each one line)."""

    problems: list[str]
    estimates: list[Estimate]
    over_limits: list[str]
    session: tuple[int, str] | None = None  # the phone's HTP session: (estimated bytes, what they are)

    def session_text(self, budget: int) -> str | None:
        if self.session is None:
            return None
        return (f"[preflight] export: ~{_mb(self.session[0])} in the phone's one HTP session "
                f"({self.session[1]}; budget {_mb(budget)}, export.max_session_bytes)")


def inspect_run(recipe, modules: dict, run_dir: Path) -> Findings:
    """Every check of `run`'s preflight over `recipe`'s stages (`modules`: stage -> module), each
    problem collected rather than raised, so `plan` can list them all at once."""
    from hyco.base.loading import preflight as check_folder

    run_dir = Path(run_dir)
    problems: list[str] = []

    def attempt(check, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except HycoError as e:
            problems.append(str(e))
            return None

    inputs = {name: attempt(module.inputs, recipe, run_dir) or {} for name, module in modules.items()}
    used = [Path(p) for paths in inputs.values() for p in paths.values()]
    sizes: dict[str, int] = {}
    unreadable: set[str] = set()  # the roles whose model folder was refused
    reported: set[Path] = set()  # inputs already refused: one line each
    for role in ROLES:
        path = recipe.path(getattr(recipe.models, role), run_dir)
        if path is not None and path in used and not _inside(path, run_dir):
            bridged = role == "verifier" and recipe.models.verifier_tokenizer is not None
            size = attempt(check_model, role, Path(path), recipe.models.family, cross_family=bridged)
            if size is None:
                unreadable.add(role)
                reported.add(Path(path))
            else:
                sizes[role] = size
    for path in dict.fromkeys(used):  # tokenizers and anything else outside the run folder
        if path in reported or _inside(path, run_dir):
            continue
        if not path.exists():
            problems.append(f"{path}: not found (an input of the recipe's stages)")
            reported.add(path)
            continue
        attempt(check_folder, path)
    for position, (name, paths) in enumerate(inputs.items()):  # the run folder's: an earlier stage writes them
        for folder, missing in unbuilt(paths.values(), run_dir, list(modules)[:position]).items():
            problems.append(f"{missing[0]}: not found, and no earlier stage of the recipe writes {folder}/ (stage "
                            f"{name} reads it)")
    if "vocab" in modules:
        attempt(check_corpus, recipe)
    if "qat" in modules and "verifier" in sizes:
        attempt(check_teacher, Path(recipe.path(recipe.models.verifier, run_dir)), recipe.qat.quantized_teacher)
    workload = recipe.path(recipe.check.workload.source, run_dir)
    if "check" in modules and workload is not None and workload not in reported:
        from hyco.data.workloads import read_workload  # every line, before hours of convert

        attempt(read_workload, workload, recipe.check.workload.schema)
    growth = {}
    if "verifier" in sizes:
        dtype = _checkpoint_dtype(Path(recipe.path(recipe.models.verifier, run_dir)))
        growth = {stage: load_growth(stage, recipe.placement, dtype) for stage in modules}
    rows = estimate(tuple(modules), sizes, growth, unreadable)
    session = npu_session_estimate(recipe, run_dir) if "export" in modules else None
    return Findings(problems, rows, over_limits(recipe, rows, run_dir) + session_over_budget(recipe, session), session)


def over_limits(recipe, rows: list[Estimate], run_dir: Path) -> list[str]:
    """Each stage whose memory estimate, and the run whose disk estimate, is over the recipe's
    `limits` (or this machine's memory, the free space where the run writes)."""
    free_disk = shutil.disk_usage(_existing(run_dir)).free / GiB
    limit_memory = recipe.limits.memory_gb or machine_memory_gb()
    limit_disk = recipe.limits.disk_gb or free_disk
    found = [f"preflight: stage {r.stage} needs ~{size_text(r.memory_gb)} of memory, over the limit of "
             f"{size_text(limit_memory)} (limits.memory_gb, or this machine's memory)"
             for r in rows if r.memory_gb > limit_memory]
    total_disk = sum(r.disk_gb for r in rows)
    if total_disk > limit_disk:
        found.append(f"preflight: the stages write ~{size_text(total_disk)}, over the limit of {size_text(limit_disk)} "
                     f"(limits.disk_gb, or the free space at {_existing(run_dir)})")
    return found


# The NPU's share of an SLM context, in bits a weight as the graphs store them (2-bit weights in
# INT4 containers unless they ship as INT2 blocks); a graph's compiled bytes ride on its weights
# within a few percent (E2B shapes: 1,038 MB binary for 1,031 MB of weights).
CONTAINER_BITS = {2: 4, 4: 4, 8: 8}
SLM_COPIES = {"tree-only": 1, "separate": 2, "shared": 1}  # export.slm_graphs: copies of the SLM's weights
HEAD_BITS = 4


def npu_session_estimate(recipe, run_dir: Path) -> tuple[int, str] | None:
    """The bytes the phone's one HTP session will hold, from the checkpoints' headers (no tensor
    read): the SLM's decoder linears at their graph widths (its output layer cut to the keep set)
    once per SLM context, plus the MTP head's linears at 4 bits. None when a model folder is made
    by an earlier stage of the run or cannot be read."""
    slm = recipe.path(recipe.models.slm, run_dir)
    if slm is None or _inside(Path(slm), run_dir) or "export" not in recipe.stages:
        return None
    try:
        slm_bytes = _slm_graph_bytes(Path(slm), recipe)
        head = recipe.path(recipe.models.assistant, run_dir)
        head_bytes = (_float_linear_params(Path(head)) * HEAD_BITS // 8
                      if head is not None and "qat" in recipe.stages and not _inside(Path(head), run_dir) else 0)
    except (HycoError, OSError, ValueError, KeyError):
        return None
    copies = SLM_COPIES[recipe.export.slm_graphs]
    total = copies * slm_bytes + head_bytes
    return total, (f"{copies} cop{'y' if copies == 1 else 'ies'} of the SLM's weights, ~{_mb(slm_bytes)} each "
                   f"(export.slm_graphs {recipe.export.slm_graphs})"
                   + (f" + the MTP head ~{_mb(head_bytes)}" if head_bytes else "") + ", weights only")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _slm_graph_bytes(folder: Path, recipe) -> int:
    from hyco.base.loading import checkpoint_files, read_json
    from hyco.formats.gemma_quant import bits_for_module

    qc = read_json(folder / "config.json", "slm config.json").get("quantization_config") or {}
    default = int(qc.get("num_bits", 4))
    total = 0
    for name, (_, shape, _) in checkpoint_files(folder, "slm").items():
        if not name.endswith("_proj.weight") and not name.endswith("lm_head.weight") \
                and not name.endswith(("per_layer_input_gate.weight", "per_layer_projection.weight")):
            continue
        if "tower" in name or "embed_" in name or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        bits = bits_for_module(module, qc.get("module_quant_configs"), default)
        weights = shape[0] * shape[1] * 8 // bits  # the stored bytes hold 8 / bits ints each
        if module.endswith("lm_head"):
            weights = weights * recipe.vocab.size // max(shape[0], recipe.vocab.size)
        # a figure under the compiled one: 2-bit weights at 2 bits unless they surely ship in INT4
        width = CONTAINER_BITS.get(bits, 8) if recipe.export.two_bit_weights == "int4-containers" else bits
        total += weights * width // 8
    return total


def _float_linear_params(folder: Path) -> int:
    from hyco.base.loading import checkpoint_files

    return sum(shape[0] * shape[1] for name, (_, shape, _) in checkpoint_files(folder, "assistant").items()
               if name.endswith("proj.weight") and len(shape) == 2)


def session_over_budget(recipe, estimate: tuple[int, str] | None) -> list[str]:
    """The estimated session over export.max_session_bytes: one line, hours before export's exact
    check on the compiled binaries would refuse it. The estimate counts weights only, so a bundle
    it refuses is over the budget compiled too."""
    if estimate is None or estimate[0] <= recipe.export.max_session_bytes:
        return []
    return [f"preflight: the bundle's contexts would hold ~{_mb(estimate[0])} in the phone's one HTP session "
            f"({estimate[1]}), over export.max_session_bytes {recipe.export.max_session_bytes:,}: export would refuse "
            "it; ways out: one copy of the SLM's weights (export.slm_graphs: tree-only), 2-bit "
            "weights at 2 bits, or smaller KV rings"]


def run_preflight(recipe, modules: dict, run_dir: Path, log=print) -> list[Estimate]:
    """Check and estimate every stage of `recipe` (`modules`: stage -> module); HycoError (one
    line, before any stage) on a missing or misshapen input or an estimate over `recipe.limits`:
    the first such problem, with a count of the others (`hyco-convert plan` lists them all)."""
    found = inspect_run(recipe, modules, run_dir)
    if found.problems:
        raise HycoError(_first_of(found.problems))
    for r in found.estimates:
        log(r.text())
    if found.session_text(recipe.export.max_session_bytes):
        log(found.session_text(recipe.export.max_session_bytes))
    if found.over_limits:
        raise HycoError(_first_of(found.over_limits))
    return found.estimates


def _first_of(problems: list[str]) -> str:
    more = len(problems) - 1
    if not more:
        return problems[0]
    return f"{problems[0]} (and {more} more problem{'s' if more > 1 else ''}: `hyco-convert plan RECIPE` lists all)"


def unbuilt(paths, run_dir: Path, built=()) -> dict[str, list[Path]]:
    """Of `paths`, those inside `run_dir` that are not there and that no stage in `built` writes,
    by the stage folder they belong to (their first folder in `run_dir`)."""
    missing: dict[str, list[Path]] = {}
    for path in map(Path, paths):
        if not _inside(path, run_dir) or path.exists():
            continue
        parts = path.resolve().relative_to(Path(run_dir).resolve()).parts
        folder = parts[0] if parts else "."
        if folder not in built:
            missing.setdefault(folder, []).append(path)
    return missing


def stage_plan(recipe, modules: dict, run_dir: Path, allow_parity_failure: bool = False) -> list[tuple[str, str, str]]:
    """Per stage, what `run` would do with it: (stage, "reuse", why) when its folder holds a finished
    build of the same recipe section and inputs, else (stage, "build", why); with the wall time of
    the build its folder holds, the one time figure there is. A stage reading a stage that is
    rebuilt is rebuilt too (its inputs' fingerprints change)."""
    from hyco.pipeline.artifacts import MANIFEST, manifest_matches, stage_key
    from hyco.pipeline.stages import stage_dir, stage_section

    rows, rebuilt = [], []
    for name, module in modules.items():
        out = stage_dir(run_dir, name)
        try:
            inputs = module.inputs(recipe, run_dir)
        except HycoError:
            rows.append((name, "build", "once its inputs are fixed (see the errors)"))
            rebuilt.append(name)
            continue
        upstream = [s for s in rebuilt if any(_inside(p, stage_dir(run_dir, s)) for p in inputs.values())]
        manifest = _manifest(out / MANIFEST)
        took = f" (its last build took {manifest['wall_s']:.1f} s)" if "wall_s" in manifest else ""
        if upstream:
            why = f"it reads {', '.join(upstream)}, {'which is' if len(upstream) == 1 else 'which are'} rebuilt"
        elif not manifest:
            why = "not built yet"
        elif not manifest_matches(out, stage_key(stage_section(module, name, recipe), inputs)):
            why = "its recipe section or inputs changed since it was built"
        elif manifest.get("proof_failed") and not allow_parity_failure:
            why = "it was kept although its proof failed"
        else:
            rows.append((name, "reuse", f"{out} matches its recipe section and inputs{took}"))
            continue
        rows.append((name, "build", why + took))
        rebuilt.append(name)
    return rows


def _manifest(path: Path) -> dict[str, Any]:
    """A stage folder's manifest, {} when there is none (or only half of one)."""
    import json

    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _inside(path: Path, run_dir: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(run_dir).resolve())


def size_text(gib: float) -> str:
    """GiB from 1 GiB up, MiB below (a tiny run's stages need MiB, which "0.0 GiB" hides)."""
    if gib >= 1:
        return f"{gib:.1f} GiB"
    return f"{gib * 1024:.0f} MiB" if gib >= 10 / 1024 else f"{gib * 1024:.1f} MiB"


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _checkpoint_dtype(folder: Path) -> str | None:
    from hyco.base.loading import read_json

    config = read_json(folder / "config.json", "verifier config.json")
    text = config.get("text_config") or {}
    return config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
