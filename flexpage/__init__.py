"""flexpage: a global paged KV cache for PyTorch models, served through FlexAttention."""

from . import masks
from .attention import fresh_prefill_attention, paged_attention
from .cache import CacheStats, PagedKVCache
from .errors import FlexpageError, OutOfPagesError, UnsupportedModelError
from .hf import unwrap, wrap
from .masks import PagedBlockMask, build_block_mask, paged_mask_mod, paged_score_mod
from .pages import PageTable, StepPlan

__all__ = [
    "CacheStats",
    "FlexpageError",
    "OutOfPagesError",
    "PageTable",
    "PagedBlockMask",
    "PagedKVCache",
    "StepPlan",
    "UnsupportedModelError",
    "build_block_mask",
    "fresh_prefill_attention",
    "masks",
    "paged_attention",
    "paged_mask_mod",
    "paged_score_mod",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"
