"""Draft tokens for speculative decoding: n-gram prompt lookup over a request's own tokens.

A proposer is any callable ``(tokens, k) -> drafts``: given a sequence's tokens so far (prompt
and output) it returns at most ``k`` tokens it guesses come next. The Engine verifies every
running sequence's drafts in one forward and keeps the longest prefix the model agrees with.
"""

from __future__ import annotations

from array import array
from typing import Callable, Sequence

Proposer = Callable[[Sequence[int], int], list[int]]


class NgramProposer:
    """Prompt lookup (as vLLM's ``ngram`` and transformers' ``prompt_lookup_num_tokens``): find the
    latest earlier occurrence of the sequence's last ``n`` tokens, longest ``n`` first from
    ``max_n`` down to ``min_n``, and propose the tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def __call__(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        data = array("q", tokens).tobytes()  # a C-speed search: 8 bytes per token
        width = array("q").itemsize
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern, end = data[-n * width :], len(data) - width  # an occurrence ending before the last token
            while (at := data.rfind(pattern, 0, end)) >= 0:
                if at % width == 0:  # on a token boundary
                    follow = at // width + n
                    return list(tokens[follow : follow + k])
                end = at + len(pattern) - 1
        return []


def proposer(speculative: str | Proposer | None, k: int, vocab_size: int) -> Proposer | None:
    """The draft source ``speculative`` names: ``"ngram"``, a proposer of one's own, or None (no
    speculation). A proposer's drafts stop at its first token outside the vocabulary."""
    if speculative is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
    if speculative == "ngram":
        return NgramProposer()
    if not callable(speculative):
        raise ValueError(f"speculative must be 'ngram' or a callable (tokens, k) -> drafts, got {speculative!r}")

    def checked(tokens: Sequence[int], limit: int) -> list[int]:
        drafts = list(speculative(tokens, limit))[:limit]
        valid = next((i for i, t in enumerate(drafts) if not (isinstance(t, int) and 0 <= t < vocab_size)), len(drafts))
        return drafts[:valid]

    return checked
