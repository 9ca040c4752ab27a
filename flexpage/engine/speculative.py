"""Draft tokens for speculative decoding: n-gram prompt lookup in a request's own tokens, or a draft model.

A proposer is any callable ``(tokens, k) -> drafts``: given a sequence's tokens so far (prompt
and output) it returns at most ``k`` tokens it guesses come next; a draft model proposes for all
of a step's sequences at once. The Engine verifies every running sequence's drafts in one forward
and keeps the longest prefix the model agrees with.
"""

from __future__ import annotations

from array import array
from typing import Callable, Sequence

from transformers import PreTrainedModel


Proposer = Callable[[Sequence[int], int], list[int]]  # one sequence's tokens, k -> its drafts
BatchProposer = Callable[[list[tuple[Sequence[int], int]]], list[list[int]]]  # a step's (tokens, k) -> drafts


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


def proposer(speculative: str | Proposer | PreTrainedModel | None, k: int, vocab_size: int,
             draft_model: Callable[[PreTrainedModel], BatchProposer]) -> BatchProposer | None:
    """The draft source ``speculative`` names, as a proposer of a step's drafts at once: ``"ngram"``,
    a draft model (made a proposer by ``draft_model``: the Engine's ``DraftModel``), a proposer
    ``(tokens, k) -> drafts`` of one's own, or None (no speculation). Drafts stop at their first
    token outside the vocabulary."""
    if speculative is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
    if isinstance(speculative, PreTrainedModel):
        if speculative.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({speculative.config.vocab_size} tokens) must be the "
                             f"target's ({vocab_size})")
        batch = draft_model(speculative)
    elif speculative == "ngram" or callable(speculative):
        one = NgramProposer() if speculative == "ngram" else speculative
        batch = lambda asks: [one(tokens, limit) for tokens, limit in asks]  # noqa: E731
    else:
        raise ValueError(f"speculative must be 'ngram', a draft model or a callable (tokens, k) -> drafts, "
                         f"got {speculative!r}")

    def checked(asks: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        out = []
        for (_, limit), drafts in zip(asks, batch(asks)):
            drafts = list(drafts)[:limit]
            valid = next((i for i, t in enumerate(drafts) if not (isinstance(t, int) and 0 <= t < vocab_size)),
                         len(drafts))
            out.append(drafts[:valid])
        return out

    return checked
