"""What a CUDA graph capture forbids, checked on a CPU: a pass run on the meta device, where a
device value cannot be read back to the host (an `.item()`, a `.tolist()`, a data-sized op such as
`nonzero` raises there, as inside a capture), under a watch that records every copy from host
memory onto the device (a capture records no pageable host-to-device copy). The capture itself
needs a GPU; this says beforehand whether a pass could be captured."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name == "_to_copy":
            src, dst = args[0], out
        elif name in ("copy_", "_copy_from"):
            dst, src = args[0], args[1]
        else:
            return out
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and any(
                isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tree_leaves(dst)):
            self.seen.append(f"{func} {tuple(src.shape)}")
        return out
