"""What every runtime run starts from: the checkpoints (float32, eager attention, the SLM's
integer weights with their scales checked) and the evaluation prompts."""

from __future__ import annotations

from pathlib import Path

import torch

from hyco.base.errors import HycoError
from hyco.config.recipe import DatasetConfig


def load_model(path: Path, what: str, placement=None):
    """`placement` (recipe.PlacementConfig; the verifier and the server's head): its dtype and
    devices, as answers and qat place the verifier (`loading.load_verifier`); None: float32 on the
    CPU (the SLM always: it stands in for the phone)."""
    from hyco.base.loading import check_scales, checkpoint_files, load_pretrained, load_verifier

    quantized = what == "SLM"  # the QAT-format checkpoint: integer weights and their scales
    if quantized:
        from hyco.formats.ct_format import gemma_layout

        path = gemma_layout(path)  # a -ct checkpoint: its proven -transformers transcode
        check_scales(checkpoint_files(path, what))
    if placement is not None and not quantized:
        model = load_verifier(path, placement, what)
    else:
        model = load_pretrained(path, what, float_checkpoint=not quantized, dtype=torch.float32)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")  # the tree masks are 4D additive masks
    return model.eval()


def _first_user(turns) -> list[str]:
    """The first non-empty user turn (as the answers stage takes it; a system turn may come first)."""
    return next(([text] for role, text in turns if role in ("user", "human") and text.strip()), [])


def load_prompt_texts(*, vocab_dir: Path | None, dataset: DatasetConfig, count: int,
                      all_available: bool = False) -> list[str]:
    """First user turns: the vocab stage's reserved evaluation prompts when it ran, else the first
    conversations of the dataset's evaluation partition (hyco/data/splits.py), which no fixture
    distillation trains on. `all_available`: every reserved prompt (at least `count`), for a
    caller that chooses among them."""
    texts = []
    prompts_file = Path(vocab_dir) / "prompts.jsonl" if vocab_dir else None
    if prompts_file is not None and prompts_file.is_file():
        from hyco.data.keepset import load_prompts as load_reserved

        for record in load_reserved(prompts_file):
            if record.get("split") == "eval":
                texts += _first_user(record["turns"])
    else:
        from hyco.data.chat import iter_conversations
        from hyco.data.splits import is_evaluation

        for conv in iter_conversations(dataset.source, dataset.schema, dataset.split):
            if not is_evaluation(conv):
                continue
            texts += _first_user(conv.turns)
            if len(texts) >= count:
                break
    if len(texts) < count:
        raise HycoError(f"check.prompts asks for {count} prompts, but {prompts_file or dataset.source} has {len(texts)}")
    return texts if all_available else texts[:count]


def load_prompts(tokenizer, *, vocab_dir: Path | None, dataset: DatasetConfig, count: int,
                 all_available: bool = False) -> list[list[int]]:
    """`load_prompt_texts` formatted with the tokenizer's chat template."""
    from hyco.data.workloads import chat_ids

    texts = load_prompt_texts(vocab_dir=vocab_dir, dataset=dataset, count=count, all_available=all_available)
    return [chat_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]
