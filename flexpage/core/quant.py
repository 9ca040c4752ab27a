"""Quantised KV pages: int8 or float8 values with a scale per token and KV head beside them.

A quantised pool is one tensor ``[1, kv_heads, slots, head_dim + 2]`` of the storage dtype: each
token's ``head_dim`` values, then the two bytes of its bfloat16 scale (absmax / the format's
largest value). Per-token scales are written once with their token: a page's scale would have
to grow (and its tokens be requantised) as the page fills. Keeping the scale inside the pool
keeps every page operation (copy-on-write, forks, prefix pages, sharding by head) a byte copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the name users give (``kv_dtype``) -> the pool's storage dtype
KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,
                                     "fp8": torch.float8_e4m3fn}
QUANTISED = (torch.int8, torch.float8_e4m3fn)
SCALE_DTYPE = torch.bfloat16  # float32's range in two bytes: no scale overflows or underflows
SCALE_WIDTH = SCALE_DTYPE.itemsize  # pool elements (bytes) per scale
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}


def kv_storage_dtype(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype of ``kv_dtype``: ``None`` (or ``"auto"``) is the model's dtype, a name in
    ``KV_DTYPES`` or a torch dtype a quantised format or the model's; ``ValueError`` otherwise."""
    if kv_dtype is None or kv_dtype == "auto":
        return model_dtype
    dtype = KV_DTYPES.get(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if dtype not in (*QUANTISED, model_dtype):
        raise ValueError(f"kv_dtype must be 'auto', one of {sorted(KV_DTYPES)} or the model's dtype "
                         f"({model_dtype}), got {kv_dtype!r}")
    return dtype


def is_quantised(pool: Tensor) -> bool:
    """Whether ``pool`` holds quantised values with their scales (``quantise``'s layout)."""
    return pool.dtype in QUANTISED


def pool_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per token and head in a pool of ``dtype``: the values, and a quantised pool's scale."""
    return head_dim + SCALE_WIDTH if dtype in QUANTISED else head_dim


def value_dim(pool: Tensor) -> int:
    """The head dimension of the values ``pool`` holds (its last dimension less any scale)."""
    return pool.shape[-1] - SCALE_WIDTH if is_quantised(pool) else pool.shape[-1]


def quantise(states: Tensor, dtype: torch.dtype) -> Tensor:
    """``states`` ``[..., D]`` as ``[..., D + SCALE_WIDTH]`` of ``dtype``: each vector's values over
    its scale (rounded to int8, or cast to float8), then the scale's bytes."""
    scale = (states.abs().amax(-1, keepdim=True).float() / _LARGEST[dtype]).to(SCALE_DTYPE)
    scaled = states.float() / scale.float().clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    limit = _LARGEST[dtype]  # dividing by the rounded scale may overshoot the largest value by a rounding
    scaled = scaled.round().clamp(-limit, limit) if dtype == torch.int8 else scaled.clamp(-limit, limit)
    return torch.cat([scaled.to(dtype), scale.view(dtype)], dim=-1)


def dequantise(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """``quantise``'s ``[..., D + SCALE_WIDTH]`` back to ``[..., D]`` values of ``dtype``."""
    dim = packed.shape[-1] - SCALE_WIDTH
    return packed[..., :dim].to(dtype) * _scales(packed).to(dtype)


def dequantise_into(packed: Tensor, out: Tensor) -> Tensor:
    """``dequantise(packed, out.dtype)`` written into ``out`` (``[..., D]``, as ``packed``'s values)
    and returned: no new memory, which for a long context's keys costs more than the arithmetic
    (fresh pages are faulted in on every call)."""
    out.copy_(packed[..., : out.shape[-1]])
    return out.mul_(_scales(packed).to(out.dtype))


def _scales(packed: Tensor) -> Tensor:
    return packed[..., packed.shape[-1] - SCALE_WIDTH :].contiguous().view(SCALE_DTYPE)


_SCRATCH: dict[tuple, Tensor] = {}  # the dequantised pools kernels read, one per name and shape (layers take turns)


def scratch_pool(pool: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """A persistent pool of ``dtype`` shaped as ``pool``'s values, one per ``name`` (``"keys"``,
    ``"values"``) and shape, that every layer's attention overwrites in turn: kernels read
    dequantised pages from it without a pool-sized allocation each call."""
    key = (name, pool.shape[:-1], value_dim(pool), dtype, pool.device)
    scratch = _SCRATCH.get(key)
    if scratch is None:
        for old in [k for k in _SCRATCH if k[0] == name]:  # one size at a time: a new cache replaces it
            del _SCRATCH[old]
        with torch.inference_mode(False):  # a plain tensor: steps in and out of inference mode write it
            scratch = torch.zeros(*pool.shape[:-1], value_dim(pool), dtype=dtype, device=pool.device)
        _SCRATCH[key] = scratch
    return scratch


def dequantised_pool(pool: Tensor, slots: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """``scratch_pool`` with ``pool``'s ``slots`` dequantised into the same slots (its other slots
    hold whatever an earlier call left there: the caller's mask never reads them). FlexAttention,
    whose pools are in the query's dtype, reads it."""
    scratch = scratch_pool(pool, dtype, name)
    scratch[:, :, slots] = dequantise(pool[:, :, slots], dtype)
    return scratch
