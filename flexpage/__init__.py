"""flexpage: a global paged KV cache for PyTorch models, served through FlexAttention."""

from .core import masks, mods
from .core.attention import packed_attention, paged_attention, sequence_attention
from .core.cache import CacheStats, PagedKVCache
from .core.masks import PackedBlockMask, SequenceKV, build_block_mask, paged_mask_mod, paged_score_mod
from .core.pages import PackedPlan, PageTable, StepPlan
from .engine import Engine
from .engine.requests import EngineStats, SamplingParams, StepOutput, TokenLogprobs
from .engine.engine import DraftModel
from .engine.speculative import NgramProposer
from .engine.structured import Grammar, GrammarLogitsProcessor, Grammars
from .errors import (FlexpageError, InvalidRequestError, OutOfPagesError, RequestFailedError, StepFailedError,
                     UnsupportedModelError)
from .hf import PagedState, paged_state, unwrap, wrap

__all__ = [
    "CacheStats",
    "DraftModel",
    "Engine",
    "EngineStats",
    "FlexpageError",
    "Grammar",
    "GrammarLogitsProcessor",
    "Grammars",
    "InvalidRequestError",
    "NgramProposer",
    "OutOfPagesError",
    "PackedBlockMask",
    "PackedPlan",
    "PageTable",
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
