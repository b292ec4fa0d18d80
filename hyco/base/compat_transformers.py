"""Every private name of transformers the project reads, in one place.

A release that renames or drops one of these fails `tests/test_compat.py` with one line naming it,
instead of a traceback deep inside convert. Each helper reads a module by what it has, never by
version number (5.25 renamed `Gemma4RMSNorm.eps` to `variance_epsilon`, for example).
"""

from __future__ import annotations

from typing import Any

from hyco.base.errors import HycoError


def rms_norm_eps(module: Any) -> float:
    """The epsilon of a transformers RMSNorm: `variance_epsilon` (5.25) or `eps` (5.24)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise HycoError(f"{type(module).__name__}: no `variance_epsilon` or `eps` attribute; this transformers "
                    "release names RMSNorm's epsilon otherwise (hyco/base/compat_transformers.py)")


def unpack_gemma_ints(packed, bits: int, width: int):
    """transformers' own unpacking of the Gemma QAT storage (int2: four per byte, int4: two per
    byte), the independent reference the bit-exact proof holds our reader to."""
    from transformers.integrations import gemma_quant

    name = {2: "_unpack_int2", 4: "_unpack_int4"}.get(bits)
    if name is None:
        raise HycoError(f"transformers unpacks 2- and 4-bit Gemma QAT storage only, not {bits}-bit")
    unpack = getattr(gemma_quant, name, None)
    if unpack is None:
        raise HycoError(f"transformers.integrations.gemma_quant has no {name} in this release "
                        "(hyco/base/compat_transformers.py)")
    return unpack(packed, width)


def dequantized_weight(module: Any, dtype=None):
    """A Gemma QAT QuantizedLinear's weight as transformers dequantizes it for its forward."""
    return module._dequantize_weights(dtype)


def skeleton_from_config(model_class: type, config: Any, **kwargs: Any):
    """`PreTrainedModel._from_config`: a model built from its config alone (what `from_config`
    does, callable on the concrete class)."""
    return model_class._from_config(config, **kwargs)
