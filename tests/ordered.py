"""A centroid-masked copy of a fixture assistant (transformers' `use_ordered_embeddings`), written
in the checkpoint's own layout: the config's three keys, `masked_embedding.centroids.weight`
and `masked_embedding.token_ordering` beside the head's tensors (one file, or a shard the index
lists).

`fitted=False`: random centroids and a random ordering (the clusters mean nothing; only the
graph's arithmetic is under test). `fitted=True`: clusters as a real ordered head has them,
near-equal output rows grouped: each token joins the best-matching of `num_centroids` seed rows
with room left (equal sizes, as token_ordering's view needs), each centroid is its members' mean
row, so the top centroids hold the tokens the dense head ranks high.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def balanced_clusters(rows: torch.Tensor, num_centroids: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ordering [V], centroids [C, H]) of equal-size clusters of `rows` [V, H]."""
    vocab = rows.shape[0]
    size = vocab // num_centroids
    g = torch.Generator().manual_seed(seed)
    unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    seeds = unit[torch.randperm(vocab, generator=g)[:num_centroids]]
    score = unit @ seeds.T  # [V, C]
    room = [size] * num_centroids
    members: list[list[int]] = [[] for _ in range(num_centroids)]
    for token in torch.argsort(score.max(1).values, descending=True).tolist():  # surest tokens first
        for c in torch.argsort(score[token], descending=True).tolist():
            if room[c]:
                room[c] -= 1
                members[c].append(token)
                break
    order = torch.tensor([t for m in members for t in m], dtype=torch.long)
    centroids = torch.stack([rows[m].mean(0) for m in members])
    return order, centroids


def ordered_assistant(src: Path, dst: Path, num_centroids: int, top_k: int, fitted: bool, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    config.update(use_ordered_embeddings=True, num_centroids=num_centroids, centroid_intermediate_top_k=top_k)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    tensors = {k: v for f in files for k, v in load_file(str(dst / f)).items()}
    table = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied: the embedding is the output layer
    if fitted:
        order, centroids = balanced_clusters(table.float(), num_centroids, seed)
    else:
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(text["vocab_size"], generator=g)
        centroids = torch.randn(num_centroids, text["hidden_size"], generator=g)
    extra = {"masked_embedding.centroids.weight": centroids.to(table.dtype).contiguous(),
             "masked_embedding.token_ordering": order}
    if index:
        save_file(extra, str(dst / "model-extra.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({k: "model-extra.safetensors" for k in extra})
        index_path.write_text(json.dumps(index))
    else:
        save_file({**tensors, **extra}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
