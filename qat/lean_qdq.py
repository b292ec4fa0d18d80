"""AIMET's weight fake-quantization, its backward done a block of rows at a time.

With trainable weight encodings, AIMET's `QuantDequantFunc.backward` builds five weight-sized
temporaries at once (the scaled, rounded and rounding-error tensors, the scale gradient's
`where` and product): several times the output layer's size (86,089 keep rows x 1,024, fp32),
the QAT's memory peak at the 26B-A4B assistant's size. `lean_weight_qdq` keeps AIMET's own
function and math but runs its backward over blocks of rows, recomputing each block's forward:
the temporaries shrink to one block's. Per-row scales make the blocks independent, so the
gradients are the same numbers (tests/test_qat.py compares them bit for bit)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

BLOCK_ELEMENTS = 1 << 22  # 16 MB of fp32 per block of rows


class _RowBlockQDQ(torch.autograd.Function):
    """QuantDequantFunc over [rows, cols] with per-row scale (and offset, or a constant scalar
    one), its backward one block of rows at a time."""

    @staticmethod
    def forward(ctx, tensor, scale, offset, qmin, qmax, zero_point_shift, qdq, rows):
        ctx.save_for_backward(tensor, scale, offset)
        ctx.args, ctx.qdq, ctx.rows = (qmin, qmax, zero_point_shift), qdq, rows
        with torch.no_grad():
            return qdq.apply(tensor, scale, offset, qmin, qmax, zero_point_shift)

    @staticmethod
    def backward(ctx, grad):
        tensor, scale, offset = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grads = [torch.empty_like(x) if need else None for x, need in zip((tensor, scale, offset), needs, strict=True)]
        for start in range(0, tensor.shape[0], ctx.rows):
            block = slice(start, start + ctx.rows)
            # a scalar offset is a constant (Dispatch checked): shared by every block
            leaves = [(x[block] if x.dim() else x).detach().requires_grad_(need)
                      for x, need in zip((tensor, scale, offset), needs, strict=True)]
            with torch.enable_grad():
                out = ctx.qdq.apply(*leaves, *ctx.args)
                block_grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], grad[block])
            for total, g in zip([g for g in grads if g is not None], block_grads, strict=True):
                total[block] = g
        return (*grads, None, None, None, None, None)


@contextlib.contextmanager
def lean_weight_qdq(block_elements: int = BLOCK_ELEMENTS) -> Iterator[None]:
    """Inside the block, AIMET's torch backend fake-quantizes a 2-D weight of more than two
    blocks' worth of elements with per-row encodings through `_RowBlockQDQ`; anything else (and
    everything outside the block) goes through AIMET's function unchanged."""
    from aimet_torch.quantization.affine.backends import torch_builtins

    original = torch_builtins.QuantDequantFunc

    class Dispatch:
        @staticmethod
        def apply(tensor, scale, offset, qmin, qmax, zero_point_shift):
            rows = tensor.shape[0] if tensor.dim() == 2 else -1
            per_row = scale.shape == (rows, 1) and (offset.shape == (rows, 1) or (offset.dim() == 0 and not offset.requires_grad))
            if (torch.is_grad_enabled() and per_row and tensor.numel() > 2 * block_elements
                    and (tensor.requires_grad or scale.requires_grad or offset.requires_grad)):
                rows = max(1, block_elements // tensor.shape[1])
                return _RowBlockQDQ.apply(tensor, scale, offset, qmin, qmax, zero_point_shift, original, rows)
            return original.apply(tensor, scale, offset, qmin, qmax, zero_point_shift)

    torch_builtins.QuantDequantFunc = Dispatch
    try:
        yield
    finally:
        torch_builtins.QuantDequantFunc = original


@contextlib.contextmanager
def weights_quantized_once(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, each AIMET-quantized module fake-quantizes its parameters once, on entry,
    and every forward reuses them, where AIMET's `_patch_quantized_parameters` quantizes them
    again on every call: at full size those calls were a large share of the qat stage's time,
    mostly re-quantizing unchanged weights in the agreement evaluations and the graph parity. Only
    for blocks that change neither weights nor weight encodings (no training step, no clip search):
    the same tensors, so the same outputs."""
    from aimet_torch.nn.base import BaseQuantizationMixin
    from aimet_torch.utils import patch_attr

    def patch_from(module, cached):
        def patch(param_names=None):
            stack = contextlib.ExitStack()
            for name in cached if param_names is None else param_names:
                stack.enter_context(patch_attr(module, name, cached[name]))
            return stack
        return patch

    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, BaseQuantizationMixin):
                    continue
                module._compute_param_encodings(overwrite=False)  # what its __call__ does first
                with module._patch_quantized_parameters():
                    cached = {name: getattr(module, name) for name in module.param_quantizers.keys()}
                module._patch_quantized_parameters = patch_from(module, cached)  # shadows the method
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module._patch_quantized_parameters
