"""Zeroed CPU tensors on transparent huge pages, for the KV pools.

A decode step reads every live page of every sequence, and once sequences have come and gone
their pages lie anywhere in a pool of tens of megabytes per layer. On 4 KB memory pages each KV
page costs TLB misses and stops the hardware prefetcher at every 4 KB boundary; on 2 MB pages
it streams (``flexpage bench attention`` times both, ``small/huge``; the README gives the figures).

Linux backs a mapping with huge pages when it is advised to (``MADV_HUGEPAGE``) and its
transparent huge pages are ``madvise`` or ``always``; elsewhere (``never``, a kernel without
them, other systems, other devices, tensors under one huge page) the memory is as
``torch.zeros``'s.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page (and most arm64 kernels')
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, a tensor of a huge page
    or more lives in an anonymous private mapping of its own, aligned to and advised onto huge
    pages, and is touched once here, as ``torch.zeros`` touches its memory (no page faults in
    later steps). The mapping is unmapped when the last tensor viewing it is freed."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or _ADVICE is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()  # it holds the mapping
    start = -storage.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(_ADVICE, start, nbytes)
    except OSError:  # a kernel built without transparent huge pages (EINVAL): small pages, as torch.zeros
        pass
    # a tensor of its own over the storage, not a view of another: a compiled forward writes
    # into it in place (through a view, inductor copies the whole base back every step)
    return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape).zero_()
