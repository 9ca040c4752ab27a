"""flexpage: a global paged KV cache for PyTorch models, served through FlexAttention."""

from . import masks, mods
from .attention import fresh_prefill_attention, packed_attention, paged_attention, sequence_attention
from .cache import CacheStats, PagedKVCache
from .engine import Engine
from .requests import EngineStats, SamplingParams, StepOutput, TokenLogprobs
from .errors import (FlexpageError, InvalidRequestError, OutOfPagesError, RequestFailedError, StepFailedError,
                     UnsupportedModelError)
from .hf import PagedState, paged_state, unwrap, wrap
from .masks import PackedBlockMask, PagedBlockMask, SequenceKV, build_block_mask, paged_mask_mod, paged_score_mod
from .pages import PackedPlan, PageTable, StepPlan
from .speculative import DraftModel, NgramProposer

__all__ = [
    "CacheStats",
    "DraftModel",
    "Engine",
    "EngineStats",
    "FlexpageError",
    "InvalidRequestError",
    "NgramProposer",
    "OutOfPagesError",
    "PackedBlockMask",
    "PackedPlan",
    "PageTable",
    "PagedBlockMask",
    "PagedKVCache",
    "PagedState",
    "RequestFailedError",
    "SamplingParams",
    "SequenceKV",
    "StepFailedError",
    "StepOutput",
    "StepPlan",
    "TokenLogprobs",
    "UnsupportedModelError",
    "build_block_mask",
    "fresh_prefill_attention",
    "masks",
    "mods",
    "packed_attention",
    "paged_attention",
    "paged_mask_mod",
    "paged_state",
    "paged_score_mod",
    "sequence_attention",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"
