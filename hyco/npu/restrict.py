"""Restrict an output layer to the keep set: keep only the rows of the kept token ids.

A logit is one row of the weight times the hidden state (plus that row's bias), so taking the
kept rows, in keep-index order, gives logits equal to the full ones at the kept ids. For
transformers' gemma `QuantizedLinear` the packed integer rows and their per-row `weight_scale`
are taken as they are (packing runs along the input dimension, so a row is whole in its
bytes); the per-tensor SRQ activation scales act elementwise and stay. Tied heads (an
embedding table used as lm_head) come out untied, as the drafters' static graphs need.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hyco.base.errors import HycoError


def _keep_index(keep_to_vocab, rows: int, where: str) -> torch.Tensor:
    index = torch.as_tensor(np.asarray(keep_to_vocab), dtype=torch.long)
    if index.ndim != 1 or (len(index) and (int(index.min()) < 0 or int(index.max()) >= rows)):
        raise HycoError(f"{where}: keep set ids must be a 1-D list within the layer's {rows} rows")
    return index


def restrict_rows(tensor: torch.Tensor, keep_to_vocab, where: str = "tensor") -> torch.Tensor:
    """Rows `keep_to_vocab` of a [vocab, ...] tensor (weights, per-row scales, encodings)."""
    return tensor.detach()[_keep_index(keep_to_vocab, tensor.shape[0], where)].clone()


def restrict_output_layer(layer: nn.Module, keep_to_vocab, where: str = "lm_head") -> nn.Module:
    """A new output layer over the keep set; `layer` is left as it was."""
    from transformers.integrations.gemma_quant import QuantizedLinear

    if isinstance(layer, QuantizedLinear):
        index = _keep_index(keep_to_vocab, layer.out_features, where)
        new = QuantizedLinear(layer.in_features, len(index), bias=layer.bias is not None, num_bits=layer.num_bits)
        with torch.no_grad():
            new.weight.copy_(layer.weight[index])
            new.weight_scale.copy_(layer.weight_scale[index])
            new.input_activation_scale.copy_(layer.input_activation_scale)
            new.output_activation_scale.copy_(layer.output_activation_scale)
            if layer.bias is not None:
                new.bias.copy_(layer.bias[index])
        return new
    if isinstance(layer, nn.Linear | nn.Embedding):
        weight = layer.weight
        index = _keep_index(keep_to_vocab, weight.shape[0], where)
        bias = getattr(layer, "bias", None)
        new = nn.Linear(weight.shape[1], len(index), bias=bias is not None, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            new.weight.copy_(weight[index])
            if bias is not None:
                new.bias.copy_(bias[index])
        return new
    raise HycoError(f"{where}: cannot restrict a {type(layer).__name__} output layer "
                    "(supported: nn.Linear, nn.Embedding used as a tied head, gemma QuantizedLinear)")
