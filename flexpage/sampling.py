"""A step's next tokens, picked for every sequence of the step at once.

Greedy rows take the argmax. Sampled rows follow transformers' warpers in ``generate()``'s
order — temperature, top-k, top-p (nucleus) — then draw from what is left, vectorised over the
rows and without a sort of the whole vocabulary: top-k and top-p look at each row's largest
logits only (``torch.topk``; a top-p row whose nucleus is wider than ``FIRST_WIDTH`` tokens takes a
sort of the whole vocabulary, as the warper always does), and the
draw inverts the kept distribution's CDF with one uniform number from the request's own
generator. On our CPU, for 32,000 logits, a full sort takes 2.5 ms a row and
``torch.multinomial`` 0.9 ms (it draws one exponential number per vocabulary entry).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

FIRST_WIDTH = 1024  # candidates a top-p row without top-k starts from (the whole vocabulary if they miss its nucleus)


def greedy_tokens(logits: Tensor) -> list[int]:
    """``logits.argmax(-1).tolist()`` for ``[rows, vocab]`` logits, 2-4x faster on CPU.

    torch's CPU argmax over a row doesn't vectorise (30 us for one row of 32000 floats, 0.44 ms
    for 32); NumPy's does (3 us and 0.08 ms), and it touches less code right after a forward,
    when every cache is cold (23 vs 48 us for one row). Ties and NaNs resolve as argmax's do
    (the first one wins). Other devices and dtypes (NumPy has no bfloat16 and a slower float16
    argmax than torch's) take torch's argmax."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def sample_tokens(logits: Tensor, temperature: Sequence[float], top_k: Sequence[int | None],
                  top_p: Sequence[float | None], generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``, drawn from the row's distribution after
    its ``temperature``, ``top_k`` and ``top_p`` (None: not applied) with its generator (None:
    torch's global one)."""
    rows = logits.shape[0]
    scores = logits.float() / torch.tensor(temperature, device=logits.device)[:, None]
    narrows = [top_k[i] is not None or top_p[i] is not None and top_p[i] < 1 for i in range(rows)]
    narrowed, whole = [i for i in range(rows) if narrows[i]], [i for i in range(rows) if not narrows[i]]
    tokens = [0] * rows
    if whole:  # the whole vocabulary, in its own order
        picked = _draw(_rows(scores, whole).softmax(-1), [generators[i] for i in whole])
        for i, token in zip(whole, picked.tolist()):
            tokens[i] = token
    if narrowed:
        ids, weights = kept_candidates(_rows(scores, narrowed), [top_k[i] for i in narrowed],
                                       [top_p[i] for i in narrowed])
        picked = ids.gather(1, _draw(weights, [generators[i] for i in narrowed])[:, None])
        for i, token in zip(narrowed, picked[:, 0].tolist()):
            tokens[i] = token
    return tokens


def kept_candidates(scores: Tensor, top_k: Sequence[int | None], top_p: Sequence[float | None]
                    ) -> tuple[Tensor, Tensor]:
    """``(ids, probs)``, both ``[rows, width]``: each row's largest scores, best first, and their
    probabilities after transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (0 where a
    warper removes the token; every token outside ``ids`` is removed). As the warpers compute
    them, up to ties with the k-th score past the candidates and float rounding at the nucleus
    boundary (the warper sums probabilities from the smallest up, this from the largest down)."""
    vocab = scores.shape[1]
    ks = torch.tensor([vocab if k is None else min(k, vocab) for k in top_k], device=scores.device)
    # no top-p (None, or 1 as the warper skips it): a bound no mass reaches, so nothing is removed
    ps = torch.tensor([float("inf") if p is None or p >= 1 else p for p in top_p], device=scores.device)
    width = min(vocab, max(FIRST_WIDTH if k is None else k for k in top_k))
    cut = ks < vocab  # rows whose top-k removes tokens: every token they keep is a candidate
    whole = None if bool(cut.all()) else scores.logsumexp(-1)  # rows without top-k: over the whole vocabulary
    while True:
        values, ids = scores.topk(width, dim=-1)  # sorted, largest first
        kth = values.gather(1, (ks.clamp_max(width) - 1)[:, None])
        values = values.masked_fill(values < kth, float("-inf"))  # top-k: below the k-th score goes
        total = values.logsumexp(-1) if whole is None else torch.where(cut, values.logsumexp(-1), whole)
        probs = (values - total[:, None]).exp()  # each candidate's share of what top-k kept
        mass = probs.cumsum(-1)
        if width == vocab or bool((cut | (mass[:, -1] >= ps)).all()):  # every nucleus lies within the candidates
            break
        width = vocab  # a flat distribution: one sort of the whole vocabulary, as the warper does
    probs = probs.masked_fill(mass - probs >= ps[:, None], 0.0)  # top-p: the mass above a kept token is < p
    return ids, probs


def _rows(scores: Tensor, rows: list[int]) -> Tensor:
    """``scores[rows]``, without a copy when that is every row."""
    return scores if len(rows) == scores.shape[0] else scores[rows]


def _draw(weights: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Index of one entry per row, drawn with probability proportional to ``weights`` (>= 0), by
    inverting the row's CDF at a uniform number from the row's generator."""
    uniform = torch.cat([torch.rand(1, generator=g, device=weights.device) for g in generators])
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    # never past the entry that completes the sum (the uniform times the total may round up to it)
    return torch.minimum(picked, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))[:, 0]
