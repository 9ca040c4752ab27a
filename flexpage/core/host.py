"""Small host-side helpers shared across the library: ceiling division, power-of-two buckets, and host
ints as a tensor."""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from .policy import device_policy

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers."""
    return -(-a // b)


def pow2_bucket(n: int, smallest: int) -> int:
    """``n`` rounded up to a power of two, at least ``smallest``: step shapes bucketed so they repeat."""
    return max(smallest, 1 << (n - 1).bit_length())


def host_tensor(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host ints as a 1-D tensor on ``device``. On the CPU the tensor wraps the ints' own buffer
    (``torch.frombuffer``): a step's host work runs right after a forward has evicted every
    cache, where ``torch.tensor`` of a few ints costs several times more. Elsewhere: one copy."""
    if device_policy(device).zero_copy_host_ints and len(values):
        return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)
