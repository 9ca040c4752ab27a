"""The shape of a packed step: how many rows its decode tokens are attended as, how its prefill
chunks are aligned and how long its chunk region is. Shapes are bucketed (powers of two) so that a
few compiled attention graphs serve every mix of lengths; ``wrap``'s generate steps and the
Engine's steps both take theirs from a ``StepShape``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from transformers import PreTrainedModel

from .attention import native_decode_for, sdpa_over_pages
from .host import cdiv, pow2_bucket

# query block of prefill chunks where FlexAttention attends them (Triton's smallest tile); where SDPA
# attends each chunk on its own (CPU) chunks need no alignment. Decode tokens are one-token rows.
CHUNK_BLOCK = 16
MIN_CHUNK_REGION = 64  # the smallest chunk-region bucket


@dataclass(frozen=True)
class StepShape:
    """Step shapes for a model on a device. ``sdpa``: a lone decode token, and each prefill chunk,
    is attended by SDPA over its sequence's pages (``sdpa_over_pages``), so those regions compile
    nothing: chunks are neither aligned nor bucketed. ``native_decode``: the C decode kernel attends
    every decode token, whatever the layer's variant (``attention.native_decode_for``).
    ``verify_rows``: a bucket of exactly this many rows besides the powers of two (a lone sequence
    verifying all its drafts, ``1 + num_speculative_tokens``: no padding rows for the linear layers
    to multiply in the commonest verification)."""

    sdpa: bool
    verify_rows: int = 0
    native_decode: bool = False

    @classmethod
    def of(cls, model: PreTrainedModel, device: torch.device, pool_dtype: torch.dtype, kv_heads: int, head_dim: int,
           verify_rows: int = 0) -> "StepShape":
        """The shapes of ``model``'s steps on ``device`` over pools of ``pool_dtype`` holding ``kv_heads``
        heads of ``head_dim`` (a ``PagedKVCache``'s)."""
        native = native_decode_for(device, model.dtype, pool_dtype, model.config.num_attention_heads, kv_heads, head_dim)
        cap = getattr(model.config, "attn_logit_softcapping", None)
        return cls(sdpa_over_pages(device, cap, 1), verify_rows, native)

    @property
    def lone_decode(self) -> bool:
        """Whether a lone decode token is its own bucket of one row: SDPA or the C kernel attends it,
        not FlexAttention (whose decode graphs start at two rows), so its linear layers multiply no
        padding row and it compiles no attention graph."""
        return self.sdpa or self.native_decode

    @property
    def chunk_block(self) -> int:
        """Each prefill chunk starts at a multiple of this many positions of the packed row."""
        return 1 if self.sdpa else CHUNK_BLOCK

    def decode_len(self, count: int) -> int:
        """The decode attention call's rows for ``count`` decode tokens: a power of two >= 2, so graphs
        are few, or 1 for a lone token (``lone_decode``), or ``verify_rows``. The rows past the real
        tokens are empty: attention skips them, the linear layers multiply them."""
        lone = count == 1 and self.lone_decode
        return count if count == 0 or lone or count == self.verify_rows else pow2_bucket(count, 2)

    def chunk_len(self, chunk_tokens: Iterable[int]) -> int:
        """The chunk region's positions for chunks of these many tokens, each aligned to ``chunk_block``:
        where FlexAttention attends them, bucketed to a power of two >= ``MIN_CHUNK_REGION``."""
        block = self.chunk_block
        aligned = sum(cdiv(n, block) * block for n in chunk_tokens)
        return aligned if self.sdpa or not aligned else pow2_bucket(aligned, MIN_CHUNK_REGION)
