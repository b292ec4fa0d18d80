"""The model families hyco-convert converts: one registered entry per family, in the spirit of
llama.cpp's `@register` and AI Hub's per-model file.

A family entry says which checkpoints it accepts (model types and the architecture each implies,
where the text model's weights sit in each layout), the weight formats its SLM may carry, its
layer-type table (the names graph I/O uses), and the MTP heads that read its verifier's state.
Every stage asks here (`family_of`) instead of testing model types itself, so a checkpoint of
another family is refused once, in one line listing what is registered, and a new family is one
entry plus the code its anatomy needs (README, "Adding a model family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyco.base.errors import HycoError


@dataclass(frozen=True)
class Layout:
    """Where the text model's weights sit in a checkpoint of one architecture."""

    name: str
    text_prefix: str  # checkpoint prefix of the text model's tensors
    ignored_prefixes: tuple[str, ...] = ()  # towers the NPU graphs leave out


@dataclass(frozen=True)
class Head:
    """An MTP head type and the verifier state it reads (the hand-off: hyco/npu/handoff.py)."""

    model_type: str
    reads: tuple[str, ...]  # the verifier's h_t and the last K/V of these layer types
    # the qat stage's step module and hand-off capture, by import path (stages sit above the core)
    step: str = ""
    capture: str = ""


@dataclass(frozen=True)
class Family:
    name: str
    architectures: dict[str, str]  # model_type -> the architecture it implies when config.json names none
    layouts: dict[str, Layout]  # architecture -> where its text weights sit
    slm_formats: tuple[str, ...]  # quantization_config.quant_method values of an SLM Drafter checkpoint
    layer_types: dict[str, str]  # config.layer_types name -> the short name graph I/O uses (mask_full, k_sliding)
    heads: dict[str, Head]  # MTP head model_type -> what it reads

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.architectures)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


GEMMA4 = register(Family(
    name="gemma4",
    architectures={"gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration"},
    layouts={
        "Gemma4ForCausalLM": Layout("text-only", "model."),
        "Gemma4ForConditionalGeneration": Layout(
            "multimodal", "model.language_model.",
            ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")),
    },
    # the QAT mobile `-transformers` checkpoints, and `-ct` (read through hyco/formats/ct_format.py)
    slm_formats=("gemma", "compressed-tensors"),
    layer_types={"full_attention": "full", "sliding_attention": "sliding"},
    # both output layers: the tied dense one (26B-A4B's assistant) and the centroid-masked one
    # (E2B/E4B's, use_ordered_embeddings: hyco/npu/ops.py centroid_mask in the step graph)
    heads={"gemma4_assistant": Head("gemma4_assistant", reads=("full_attention", "sliding_attention"),
                                    step="hyco.qat.step_graph:MtpStep", capture="hyco.npu.handoff:handoff_states")},
))


def registered() -> str:
    """One line: each family with the model types it accepts."""
    return "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES.values())


def family_of(config: dict[str, Any], where: str, name: str | None = None) -> Family:
    """The family of a checkpoint's config.json (`where` names the file), or the recipe's
    `models.family`, which must then be the checkpoint's too."""
    kind = config.get("model_type")
    found = next((f for f in FAMILIES.values() if kind in f.model_types), None)
    if name is not None and name not in FAMILIES:
        raise HycoError(f"models.family {name!r} is not a registered family (registered: {registered()})")
    if found is None:
        raise HycoError(f"{where}: model_type {kind!r} is no registered family's (registered: {registered()})")
    if name is not None and found.name != name:
        raise HycoError(f"{where}: model_type {kind!r} is family {found.name!r}, but models.family is {name!r}")
    return found


def head_of(config: dict[str, Any], where: str) -> tuple[Family, Head]:
    """The family whose verifier an MTP head's config.json reads, and the head's entry."""
    kind = config.get("model_type")
    for family in FAMILIES.values():
        if kind in family.heads:
            return family, family.heads[kind]
    heads = "; ".join(f"{f.name} ({', '.join(f.heads)})" for f in FAMILIES.values())
    raise HycoError(f"{where}: model_type {kind!r} is no registered MTP head (registered: {heads})")


def architecture(config: dict[str, Any]) -> str | None:
    """The config's first architecture, else the one its model_type implies."""
    named = (config.get("architectures") or [None])[0]
    if named:
        return named
    kind = config.get("model_type")
    return next((f.architectures[kind] for f in FAMILIES.values() if kind in f.architectures), None)


def layout_of(arch: str | None) -> Layout | None:
    return next((f.layouts[arch] for f in FAMILIES.values() if arch in f.layouts), None)
