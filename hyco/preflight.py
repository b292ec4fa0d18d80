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

from hyco.errors import HycoError

GiB = 1024**3

# Per model role: its quantization (the SLM's: one of its family's SLM formats, hyco/families.py)
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
    from hyco.loading import checkpoint_files

    tensors = checkpoint_files(folder, folder.name)
    return sum(p.stat().st_size for p in {path for _, _, path in tensors.values()})


def check_model(role: str, folder: Path, family: str | None = None, *, cross_family: bool = False) -> int:
    """`folder` laid out as the `role` needs: a registered family's model type (`family`: the
    recipe's models.family, which it must then be) and quantization method, index and shard
    headers whole, the tensors the stages read present. `cross_family`: a verifier of another
    family, drafted for through the token bridge (models.verifier_tokenizer): any decoder
    transformers loads, no family asked. Returns its weight bytes."""
    from hyco.families import family_of, head_of
    from hyco.loading import checkpoint_files, config_quant_method, read_json

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
        from hyco.loading import check_server_quant

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
    from hyco.loading import quant_method

    method = quant_method(verifier, "verifier")
    if method is not None and not quantized_teacher:
        raise HycoError(f"{verifier / 'config.json'}: models.verifier is quantized ({method!r}), and qat distills the "
                        "MTP head against its states: point models.verifier at the BF16 checkpoint for qat (and set "
                        "it back for check), or set qat.quantized_teacher: true")


def check_corpus(recipe) -> None:
    """The chat corpus the vocab stage counts: its first conversation can be read."""
    from hyco.chat import iter_conversations

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


def estimate(stages: tuple[str, ...], sizes: dict[str, int], growth: dict[str, float] | None = None) -> list[Estimate]:
    """`growth`: per stage, the verifier's `load_growth`."""
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
                 else f"not estimated (its {mem_role} is made by an earlier stage of this run)")
        rows.append(Estimate(stage, memory, disk, "CPU (onnxruntime, QNN)" if onnx else where, basis))
    return rows


def machine_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def run_preflight(recipe, modules: dict, run_dir: Path, log=print) -> list[Estimate]:
    """Check and estimate every stage of `recipe` (`modules`: stage -> module); HycoError (one
    line, before any stage) on a missing or misshapen input or an estimate over `recipe.limits`."""
    from hyco.loading import preflight as check_folder

    run_dir = Path(run_dir)
    sizes: dict[str, int] = {}
    for role in ROLES:
        path = recipe.path(getattr(recipe.models, role), run_dir)
        used = path is not None and any(path == p for m in modules.values() for p in m.inputs(recipe, run_dir).values())
        if used and not Path(path).resolve().is_relative_to(run_dir.resolve()):
            bridged = role == "verifier" and recipe.models.verifier_tokenizer is not None
            sizes[role] = check_model(role, Path(path), recipe.models.family, cross_family=bridged)
    for module in modules.values():  # tokenizers and anything else outside the run folder
        for path in module.inputs(recipe, run_dir).values():
            if not Path(path).resolve().is_relative_to(run_dir.resolve()):
                if not Path(path).exists():
                    raise HycoError(f"{path}: not found (an input of the recipe's stages)")
                check_folder(path)
    if "vocab" in modules:
        check_corpus(recipe)
    if "qat" in modules and "verifier" in sizes:
        check_teacher(Path(recipe.path(recipe.models.verifier, run_dir)), recipe.qat.quantized_teacher)
    if "check" in modules and recipe.check.workload.source is not None:  # every line, before hours of convert
        from hyco.workloads import read_workload

        read_workload(recipe.path(recipe.check.workload.source, run_dir), recipe.check.workload.schema)
    growth = {}
    verifier = recipe.path(recipe.models.verifier, run_dir)
    if "verifier" in sizes:
        dtype = _checkpoint_dtype(Path(verifier))
        growth = {stage: load_growth(stage, recipe.placement, dtype) for stage in modules}
    rows = estimate(tuple(modules), sizes, growth)
    free_disk = shutil.disk_usage(_existing(run_dir)).free / GiB
    limit_memory = recipe.limits.memory_gb or machine_memory_gb()
    limit_disk = recipe.limits.disk_gb or free_disk
    for r in rows:
        log(r.text())
    total_disk = sum(r.disk_gb for r in rows)
    for r in rows:
        if r.memory_gb > limit_memory:
            raise HycoError(f"preflight: stage {r.stage} needs ~{size_text(r.memory_gb)} of memory, over the limit of "
                            f"{size_text(limit_memory)} (limits.memory_gb, or this machine's memory)")
    if total_disk > limit_disk:
        raise HycoError(f"preflight: the stages write ~{size_text(total_disk)}, over the limit of {size_text(limit_disk)} "
                        f"(limits.disk_gb, or the free space at {_existing(run_dir)})")
    return rows


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
    from hyco.loading import read_json

    config = read_json(folder / "config.json", "verifier config.json")
    text = config.get("text_config") or {}
    return config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
