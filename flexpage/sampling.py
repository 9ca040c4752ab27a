"""A step's next tokens, picked for every sequence of the step at once.

Greedy rows take the argmax. Sampled rows follow transformers' warpers in ``generate()``'s
order — temperature, top-k, top-p (nucleus) — then draw from what is left, vectorised over the
rows and without a sort of the whole vocabulary: top-k and top-p look at each row's largest
logits only (``torch.topk``), a top-p row whose nucleus is wider than ``FIRST_WIDTH`` tokens finds
its cut by a radix select over the whole vocabulary (the warper sorts it), and the draw inverts
the kept distribution's CDF with one uniform number from the request's own generator. On our CPU,
for 32,000 logits, a sort takes 1.8-2.5 ms a row and ``torch.multinomial`` 0.9 ms (it draws one
exponential number per vocabulary entry).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

FIRST_WIDTH = 1024  # candidates a top-p row without top-k starts from (the whole vocabulary if they miss its nucleus)
RADIX_DIGITS = ((20, 11), (9, 11), (0, 9))  # (shift, bits) of each pass over a float's 31 non-sign bits


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
    rows, vocab = logits.shape
    top_k = [k if k is not None and k < vocab else None for k in top_k]  # keeping every token is no top-k
    top_p = [p if p is not None and p < 1 else None for p in top_p]  # the warper skips a top-p of 1
    uniform = torch.cat([torch.rand(1, generator=g, device=logits.device) for g in generators])
    tokens = [0] * rows
    narrowed = [i for i in range(rows) if top_k[i] is not None or top_p[i] is not None]
    whole = [i for i in range(rows) if top_k[i] is None and top_p[i] is None]
    if narrowed:
        ids, probs, within = kept_candidates(_rows(logits, narrowed), [temperature[i] for i in narrowed],
                                             [top_k[i] for i in narrowed], [top_p[i] for i in narrowed])
        flags = within.tolist()
        done = [j for j in range(len(narrowed)) if flags[j]]
        if done:
            drawn = _draw(_rows(probs, done), uniform[[narrowed[j] for j in done]])
            for j, token in zip(done, _rows(ids, done).gather(1, drawn[:, None])[:, 0].tolist()):
                tokens[narrowed[j]] = token
        whole = sorted(whole + [narrowed[j] for j in range(len(narrowed)) if not flags[j]])  # wide nuclei
    if whole:  # over the whole vocabulary, in its own order
        probs = _scaled(_rows(logits, whole), [temperature[i] for i in whole]).softmax(-1)
        nucleus = [j for j, i in enumerate(whole) if top_p[i] is not None]
        if nucleus:
            probs[nucleus] = top_p_filtered(_rows(probs, nucleus), [top_p[whole[j]] for j in nucleus])
        for i, token in zip(whole, _draw(probs, uniform[whole]).tolist()):
            tokens[i] = token
    return tokens


def kept_candidates(logits: Tensor, temperature: Sequence[float], top_k: Sequence[int | None],
                    top_p: Sequence[float | None]) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids, probs, within)``: ``ids`` and ``probs`` ``[rows, width]`` are each row's largest
    logits, best first, and their probabilities after temperature and transformers'
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (0 where a warper removes the token; every token
    outside ``ids`` is removed), for the rows where ``within`` ``[rows]`` is true: a row without
    top-k whose nucleus is wider than its candidates is not (``top_p_filtered`` serves it). As the
    warpers compute them, up to ties with the k-th score past the candidates and float rounding at
    the nucleus boundary (the warper sums probabilities from the smallest up, this from the largest
    down)."""
    vocab = logits.shape[1]
    ks = torch.tensor([vocab if k is None else min(k, vocab) for k in top_k], device=logits.device)
    # no top-p (None, or 1 as the warper skips it): a bound no mass reaches, so nothing is removed
    ps = torch.tensor([float("inf") if p is None or p >= 1 else p for p in top_p], device=logits.device)
    width = min(vocab, max(FIRST_WIDTH if k is None else k for k in top_k))
    values, ids = logits.topk(width, dim=-1)  # largest first; dividing by a temperature keeps the order
    values = _scaled(values, temperature)
    kth = values.gather(1, (ks.clamp_max(width) - 1)[:, None])
    values = values.masked_fill(values < kth, float("-inf"))  # top-k: below the k-th score goes
    cut = ks < vocab  # rows whose top-k removes tokens: every token they keep is a candidate
    total = values.logsumexp(-1)
    if not bool(cut.all()):  # rows without top-k: normalised over the whole vocabulary
        total = torch.where(cut, total, _scaled(logits, temperature).logsumexp(-1))
    probs = (values - total[:, None]).exp()  # each candidate's share of what top-k kept
    mass = probs.cumsum(-1)
    probs = probs.masked_fill(mass - probs >= ps[:, None], 0.0)  # top-p: the mass above a kept token is < p
    return ids, probs, cut | (mass[:, -1] >= ps) | (width == vocab)


def top_p_filtered(probs: Tensor, top_p: Sequence[float]) -> Tensor:
    """``probs`` ``[rows, vocab]`` with what ``TopPLogitsWarper`` removes set to 0, without a sort
    (1.8-2.5 ms a row of 32,000 on our CPU): a token is kept when the tokens above it hold less than
    ``top_p``, i.e. when its probability is at least the largest value ``t`` whose tokens at or above
    it hold ``top_p`` or more. A non-negative float orders as its bits, so ``t`` is found exactly
    by a radix select over them: three passes of a mass histogram, each fixing the next bits. All
    in int32 arithmetic: on our CPU int64 shifts and comparisons into bool masks run ~10x slower."""
    ps = torch.tensor(top_p, device=probs.device)[:, None]
    bits = probs.view(torch.int32)
    found = torch.zeros_like(bits[:, :1])  # t's bits fixed so far (the high ones)
    # reused by every pass: each fresh megabyte costs page faults
    digit, index = torch.empty_like(bits), torch.empty_like(bits, dtype=torch.int64)
    for shift, width in RADIX_DIGITS:
        # each token's next digit where it shares t's high bits; -1 below them and 1 << width above
        torch.bitwise_right_shift(bits, shift, out=digit).sub_(found << width).clamp_(-1, 1 << width).add_(1)
        mass = torch.zeros(probs.shape[0], (1 << width) + 2, device=probs.device)
        at_or_above = mass.scatter_add_(1, index.copy_(digit), probs).flip(-1).cumsum(-1).flip(-1)
        # the largest digit whose tokens and those above hold p (at least digit 0: float sums in
        # another order may round just below p)
        chosen = (at_or_above[:, 1:-1] >= ps).sum(-1, keepdim=True).sub_(1).clamp_(min=0)
        found = (found << width) | chosen.int()
    return probs * torch.sub(bits, found, out=digit).add_(1).clamp_(0, 1)  # 1 where bits >= found's


def _scaled(logits: Tensor, temperature: Sequence[float]) -> Tensor:
    """``logits`` divided row by row by ``temperature`` (as a float32 copy; no copy when every
    temperature is 1 and the logits are float32 already)."""
    if all(t == 1.0 for t in temperature):
        return logits.float()
    return logits.float() / torch.tensor(temperature, device=logits.device)[:, None]


def _rows(scores: Tensor, rows: list[int]) -> Tensor:
    """``scores[rows]``, without a copy when that is every row."""
    return scores if len(rows) == scores.shape[0] else scores[rows]


def _draw(weights: Tensor, uniform: Tensor) -> Tensor:
    """Index of one entry per row, drawn with probability proportional to ``weights`` (>= 0), by
    inverting the row's CDF at the row's ``uniform`` number in [0, 1)."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    # never past the entry that completes the sum (the uniform times the total may round up to it)
    return torch.minimum(picked, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))[:, 0]
