"""The mod library: attention variants as FlexAttention ``mask_mod`` / ``score_mod`` functions.

Each mod is a tiny pure function of logical coordinates (``q_idx`` / ``kv_idx`` are token
positions in the sequence), usable with plain FlexAttention too; ``flexpage.masks`` remaps any
of them to the pages of a paged cache.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Each token sees itself and the tokens before it."""
    return q_idx >= kv_idx


causal.within_causal = True  # type: ignore[attr-defined]


def sliding_window(window: int) -> MaskMod:
    """Causal attention to the last ``window`` tokens (the query included)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    sliding_window_mask.within_causal = True  # type: ignore[attr-defined]
    return sliding_window_mask


def prefix_lm(prefix_lens: Tensor) -> MaskMod:
    """Bidirectional over each row's first ``prefix_lens[b]`` tokens, causal after them."""

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lens[b]) | (q_idx >= kv_idx)

    return prefix_lm_mask


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2): ``cap * tanh(score / cap)``."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_score


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi: add ``slopes[h] * (kv_idx - q_idx)`` to each score."""

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_score


def alibi_slopes(num_heads: int) -> Tensor:
    """The geometric slopes of the ALiBi paper (num_heads a power of two)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])
