"""A step's next tokens, picked for every sequence of the step at once.

Greedy rows take the argmax. Sampled rows follow transformers' warpers in ``generate()``'s
order — temperature, top-k, top-p (nucleus) — then draw from what is left, vectorised over the
rows and without a sort of the whole vocabulary (the top-p warper sorts it): top-k looks at each
row's k largest logits only (``torch.topk``); a top-p row draws from its whole distribution and
keeps the draw when it lies in the nucleus (the probability above the drawn token is less than p:
one pass over the row), else draws again (rejection sampling: the draws kept follow the nucleus's
distribution exactly, and one lands in it with probability at least p); after
``NUCLEUS_TRIES`` misses the row draws from its nucleus found exactly (``top_p_filtered``). A draw
inverts the CDF at a uniform number from the request's own generator (over the whole vocabulary,
by blocks: ``BlockedCdf``). A sort of the vocabulary, or ``torch.multinomial`` (one exponential
number per vocabulary entry), costs several times more per row.

Sampling is total: temperatures below ``MIN_TEMPERATURE`` are raised to it (as vLLM does), and a
row with nothing to draw from (NaN or infinite logits) yields ``None``, never a token outside the
vocabulary and never an error for the other rows.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.policy import device_policy

NUCLEUS_TRIES = 4  # draws a top-p row may reject before its nucleus is computed (at p = 0.9: 1e-4 of rows)
FIRST_WIDTH = 256  # where top_p_filtered looks for its threshold first (a radix select if they miss the nucleus)
RADIX_DIGITS = ((20, 11), (9, 11), (0, 9))  # (shift, bits) of each pass over a float's 31 non-sign bits
BLOCK = 256  # tokens per block of a BlockedCdf
MANY_ROWS = 16  # from this many whole-vocabulary rows the CPU's Sampler uses its scratch and a BlockedCdf
MIN_TEMPERATURE = 0.01  # lower temperatures are raised to this (below it logits / t overflow float32)


def greedy_tokens(logits: Tensor) -> list[int]:
    """``logits.argmax(-1).tolist()`` for ``[rows, vocab]`` logits, 2-4x faster on CPU.

    torch's CPU argmax over a row doesn't vectorise; NumPy's does, and it touches less code right
    after a forward, when every cache is cold. Ties and NaNs resolve as argmax's do
    (the first one wins). Half-precision logits are widened to float32 first (exactly: the same
    order, the same ties), which with NumPy's argmax is 5-15x faster than torch's bfloat16 argmax.
    Other devices take torch's argmax."""
    if device_policy(logits.device).host_sampling and logits.is_floating_point():
        return logits.float().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    """Draws a step's sampled tokens (``__call__``). On the CPU, ``MANY_ROWS`` or more rows over the
    whole vocabulary write their probabilities into a scratch the sampler keeps from step to step
    (a fresh tensor of many rows of a large vocabulary costs page faults, more than the
    softmax written into it; fewer rows allocate, which costs less than slicing the scratch) and
    draw through a ``BlockedCdf``. The scratch grows to the most such rows a step has had; an Engine
    keeps one ``Sampler``."""

    def __init__(self) -> None:
        self._scratch: Tensor | None = None

    def __call__(self, logits: Tensor, temperature: Sequence[float], top_k: Sequence[int | None],
                 top_p: Sequence[float | None], generators: Sequence[torch.Generator | None]) -> list[int | None]:
        """One token per row of ``logits`` ``[rows, vocab]``, drawn from the row's distribution after
        its ``temperature`` (at least ``MIN_TEMPERATURE``), ``top_k`` and ``top_p`` (None: not
        applied) with its generator (None: torch's global one); None for a row whose logits give no
        distribution (NaN, +inf, or every logit -inf)."""
        rows, vocab = logits.shape
        temperature = [max(t, MIN_TEMPERATURE) for t in temperature]
        top_k = [k if k is not None and k < vocab else None for k in top_k]  # keeping every token is no top-k
        top_p = [p if p is not None and p < 1 else None for p in top_p]  # the warper skips a top-p of 1
        # a top-p row over the whole vocabulary may draw again: its uniforms are drawn up front too
        draws = [torch.rand(1 + NUCLEUS_TRIES * (top_k[i] is None and top_p[i] is not None), generator=g,
                            device=logits.device) for i, g in enumerate(generators)]
        uniform = torch.cat([d[:1] for d in draws])
        tokens: list[int | None] = [0] * rows
        cut = [i for i in range(rows) if top_k[i] is not None]
        whole = [i for i in range(rows) if top_k[i] is None]
        if cut:  # the k largest logits hold everything the row keeps
            ids, probs = kept_candidates(_rows(logits, cut), [temperature[i] for i in cut],
                                         [top_k[i] for i in cut], [top_p[i] for i in cut])
            cdf = Cdf(probs)
            picked = ids.gather(1, cdf.invert(uniform[cut])[:, None])
            for i, token, valid in zip(cut, picked[:, 0].tolist(), cdf.valid()):
                tokens[i] = token if valid else None
        if whole:  # over the whole vocabulary, in its own order
            scores, temperatures = _rows(logits, whole), [temperature[i] for i in whole]
            if device_policy(logits.device).host_sampling and len(whole) >= MANY_ROWS:
                cdf = BlockedCdf(self._probs(scores, temperatures))
            else:  # few rows; or a GPU: it allocates from a cache, and its cumsum is one kernel against the blocks' ~15
                cdf = Cdf(_scaled(scores, temperatures).softmax(-1))
            picked, valid = cdf.invert(uniform[whole]).tolist(), cdf.valid()
            nucleus = [(j, top_p[i], draws[i]) for j, i in enumerate(whole) if top_p[i] is not None and valid[j]]
            if nucleus:
                _into_nucleus(cdf, picked, nucleus)
            for i, token, ok in zip(whole, picked, valid):
                tokens[i] = token if ok else None
        return tokens

    def _probs(self, logits: Tensor, temperature: Sequence[float]) -> Tensor:
        """``softmax(logits / temperature)`` row by row (float32), written into the scratch."""
        size = logits.numel()
        if self._scratch is None or self._scratch.device != logits.device or self._scratch.numel() < size:
            self._scratch = torch.empty(size, device=logits.device)
        probs = self._scratch[:size].view(logits.shape)
        torch.div(logits, _divisor(temperature, logits.device), out=probs)
        return torch.softmax(probs, -1, out=probs)


def sample_tokens(logits: Tensor, temperature: Sequence[float], top_k: Sequence[int | None],
                  top_p: Sequence[float | None], generators: Sequence[torch.Generator | None]) -> list[int | None]:
    """``Sampler()(...)`` for a one-off draw (its scratch goes with it)."""
    return Sampler()(logits, temperature, top_k, top_p, generators)


class Cdf:
    """Draws from rows of ``weights`` ``[rows, vocab]`` (>= 0) by inverting their cumulative sums."""

    def __init__(self, weights: Tensor) -> None:
        self.weights, self.cumulative = weights, weights.cumsum(-1)

    def invert(self, uniform: Tensor, rows: list[int] | None = None) -> Tensor:
        """For each row (of ``rows``; default all), the first token whose cumulative weight exceeds
        its ``uniform`` number in [0, 1) times the row's total."""
        cdf = self.cumulative if rows is None else _rows(self.cumulative, rows)
        return _search(cdf, uniform[:, None] * cdf[:, -1:])[:, 0]

    def valid(self) -> list[bool]:
        """Whether each row has a distribution to draw from (a finite, positive total)."""
        return _positive(self.cumulative[:, -1])


class BlockedCdf:
    """Draws from rows of ``weights`` ``[rows, vocab]`` (>= 0) by inverting their cumulative sums
    without a cumsum over the whole vocabulary (a sequential scan, many times a sum's cost on the
    CPU): the sums of ``BLOCK``-token blocks, accumulated, find a
    draw's block, and the cumsum of that block alone its token."""

    def __init__(self, weights: Tensor) -> None:
        rows, vocab = weights.shape
        whole = vocab // BLOCK * BLOCK
        sums = weights[:, :whole].reshape(rows, -1, BLOCK).sum(-1)
        if whole < vocab:  # the last, shorter block
            sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], 1)
        self.weights, self.ends = weights, sums.cumsum(-1)
        self.starts = self.ends - sums  # the weight before each block
        self.offsets = torch.arange(BLOCK, device=weights.device)

    def invert(self, uniform: Tensor, rows: list[int] | None = None) -> Tensor:
        """For each row (of ``rows``; default all), the first token whose cumulative weight exceeds
        its ``uniform`` number in [0, 1) times the row's total."""
        weights, ends, starts = self.weights, self.ends, self.starts
        if rows is not None:
            weights, ends, starts = _rows(weights, rows), _rows(ends, rows), _rows(starts, rows)
        target = uniform[:, None] * ends[:, -1:]
        block = _search(ends, target)
        tokens = block * BLOCK + self.offsets
        vocab = weights.shape[1]
        if vocab % BLOCK:  # past the last, shorter block: no weight
            inside = weights.gather(1, tokens.clamp_max(vocab - 1)).masked_fill_(tokens >= vocab, 0.0)
        else:
            inside = weights.gather(1, tokens)
        token = block * BLOCK + _search(inside.cumsum(-1), target - starts.gather(1, block))
        return token[:, 0].clamp_(max=vocab - 1)  # a NaN row may search past the last, shorter block

    def valid(self) -> list[bool]:
        """Whether each row has a distribution to draw from (a finite, positive total)."""
        return _positive(self.ends[:, -1])


def _positive(totals: Tensor) -> list[bool]:
    """Which rows' total weights are finite and positive (a NaN or infinite logit makes them NaN)."""
    return [math.isfinite(total) and total > 0 for total in totals.tolist()]


def _into_nucleus(cdf: Cdf | BlockedCdf, picked: list[int], rows: list[tuple[int, float, Tensor]]) -> None:
    """Rejection sampling into each top-p row's nucleus, in place in ``picked``: for ``(row, p,
    uniforms)`` the row's drawn token stays when the probability above it (of tokens more likely
    than it) is less than p, the rule of transformers' warper; otherwise the row draws again with its
    next uniform, ``NUCLEUS_TRIES`` draws at most, then from its nucleus found exactly with its last."""
    probs = cdf.weights
    values = probs.gather(1, torch.tensor(picked, device=probs.device)[:, None])[:, 0].tolist()
    for k in range(NUCLEUS_TRIES):
        if k:  # the rows whose last draw missed draw again
            index = [row for row, _, _ in rows]
            again = cdf.invert(torch.cat([uniform[k : k + 1] for _, _, uniform in rows]), index)
            chances = probs[torch.tensor(index, device=probs.device), again]
            for row, token, value in zip(index, again.tolist(), chances.tolist()):
                picked[row], values[row] = token, value
        above = mass_above(probs, [row for row, _, _ in rows], [values[row] for row, _, _ in rows])
        rows = [entry for entry, mass in zip(rows, above) if mass >= entry[1]]
        if not rows:
            return
    for row, p, uniform in rows:
        picked[row] = int(_draw(top_p_filtered(probs[row : row + 1], [p]), uniform[-1:])[0])


def mass_above(probs: Tensor, rows: list[int], values: list[float], row_by_row: bool | None = None) -> list[float]:
    """For each of ``rows`` of ``probs``, the probability of its tokens more likely than its value
    in ``values``. One pass over the rows at once, or (on the CPU, where comparisons into bool masks
    and fresh megabytes cost more than a loop) a row at a time into one reused row."""
    if row_by_row is None:
        row_by_row = device_policy(probs.device).host_sampling
    if row_by_row:
        scratch = probs.new_empty(probs.shape[1])
        return [float(torch.threshold(probs[row], value, 0.0, out=scratch).sum()) for row, value in zip(rows, values)]
    chosen = _rows(probs, rows)
    bound = torch.tensor(values, dtype=probs.dtype, device=probs.device)[:, None]
    return torch.where(chosen > bound, chosen, 0.0).sum(-1).tolist()


def kept_candidates(logits: Tensor, temperature: Sequence[float], top_k: Sequence[int],
                    top_p: Sequence[float | None]) -> tuple[Tensor, Tensor]:
    """``(ids, probs)``, both ``[rows, max(top_k)]``: each row's largest logits, best first, and
    their probabilities after temperature and transformers' ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (0 where a warper removes the token; every token outside ``ids`` is
    removed). As the warpers compute them, up to ties with the k-th score past the candidates and
    float rounding at the nucleus boundary (the warper sums probabilities from the smallest up,
    this from the largest down)."""
    ks = torch.tensor(top_k, device=logits.device)
    # no top-p (None, or 1 as the warper skips it): a bound no mass reaches, so nothing is removed
    ps = torch.tensor([float("inf") if p is None or p >= 1 else p for p in top_p], device=logits.device)
    # largest first; dividing by a temperature keeps their order
    values, ids = logits.topk(min(max(top_k), logits.shape[1]), dim=-1)
    values = _scaled(values, temperature)
    kth = values.gather(1, (ks.clamp_max(values.shape[1]) - 1)[:, None])
    values = values.masked_fill(values < kth, float("-inf"))  # top-k: below the k-th score goes
    probs = values.softmax(-1)  # each candidate's share of what top-k kept
    above = probs.cumsum(-1) - probs
    # top-p: the mass above a kept token is < p; the most likely token stays whatever p (as the warper's
    # min_tokens_to_keep), also where p is below float32's smallest value and rounds to 0
    return ids, probs.masked_fill((above >= ps[:, None]) & (above > 0), 0.0)


def top_p_filtered(probs: Tensor, top_p: Sequence[float | None]) -> Tensor:
    """``probs`` ``[rows, vocab]`` (float32), with what ``TopPLogitsWarper`` removes set to 0 in
    place (rows whose ``top_p`` is None stay as they are), without a sort of the whole vocabulary:
    a token is kept when the tokens above it hold less than ``top_p``, i.e. when its probability is
    at least the largest value ``t`` whose tokens at or above it hold ``top_p`` or more. ``t`` comes
    from the row's ``FIRST_WIDTH`` largest probabilities when they hold ``top_p``; otherwise (a flat
    distribution) from ``_radix_select``. Float rounding may decide a token whose tokens above hold
    ``top_p`` within it otherwise than the warper does."""
    rows = [r for r, p in enumerate(top_p) if p is not None]
    chosen = _rows(probs, rows)
    ps = torch.tensor([top_p[r] for r in rows], device=probs.device)[:, None]
    threshold = torch.full_like(ps, -1.0)  # -1: not found yet
    # the candidates cannot hold p when even the largest probability times their count is less
    peaked = (chosen.amax(-1, keepdim=True) * FIRST_WIDTH >= ps)[:, 0].nonzero()[:, 0].tolist()
    if peaked:
        values = _rows(chosen, peaked).topk(min(FIRST_WIDTH, probs.shape[1]), dim=-1).values
        reached = (values.cumsum(-1) < ps[peaked]).sum(-1, keepdim=True)  # candidates before p is reached
        last = values.gather(1, reached.clamp_max(values.shape[1] - 1))
        threshold[peaked] = torch.where(reached < values.shape[1], last, -1.0)
    flat = (threshold < 0)[:, 0].nonzero()[:, 0].tolist()
    if flat:  # t's bits; 0 when the mass rounds below p: everything is kept
        threshold[flat] = _radix_select(_rows(chosen, flat), ps[flat]).view(torch.float32)
    # a row at a time, in place: whole-vocabulary temporaries cost more here (page faults) than the
    # loop; F.threshold keeps what is above its bound, the float just below t (t = 0 keeps all)
    below = torch.where(threshold > 0, (threshold.view(torch.int32) - 1).view(torch.float32), -1.0)
    for r, bound in zip(rows, below[:, 0].tolist()):
        F.threshold_(probs[r], bound, 0.0)
    return probs


def _radix_select(probs: Tensor, ps: Tensor) -> Tensor:
    """The bits (int32 ``[rows, 1]``) of the largest value ``t`` whose tokens at or above it hold
    ``ps`` ``[rows, 1]`` or more of ``probs``. A non-negative float orders as its bits, so ``t``
    is found exactly by three passes of a mass histogram, each fixing the next bits; in int32
    arithmetic, as CPUs run int64 shifts and comparisons into bool masks much slower."""
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
    return found


def _scaled(logits: Tensor, temperature: Sequence[float]) -> Tensor:
    """``logits`` divided row by row by ``temperature`` (as a float32 copy; no copy when every
    temperature is 1 and the logits are float32 already)."""
    if all(t == 1.0 for t in temperature):
        return logits.float()
    return logits.float() / _divisor(temperature, logits.device)


def _divisor(temperature: Sequence[float], device: torch.device) -> float | Tensor:
    """The rows' temperatures: one number when they agree (no tensor to build, slow with cold
    caches), else a column."""
    return temperature[0] if len(set(temperature)) == 1 else torch.tensor(temperature, device=device)[:, None]


def _rows(scores: Tensor, rows: list[int]) -> Tensor:
    """``scores[rows]``, without a copy when that is every row (``index_select``: on the CPU several
    times faster than indexing with a list)."""
    return scores if len(rows) == scores.shape[0] else scores.index_select(0, torch.tensor(rows, device=scores.device))


def _draw(weights: Tensor, uniform: Tensor) -> Tensor:
    """Index of one entry per row, drawn with probability proportional to ``weights`` (>= 0), by
    inverting the row's CDF at the row's ``uniform`` number in [0, 1)."""
    return Cdf(weights).invert(uniform)


def _search(cdf: Tensor, target: Tensor) -> Tensor:
    """Each row's first index (``[rows, 1]``) whose cumulative weight ``cdf`` exceeds ``target``
    ``[rows, 1]``, never past the entry that completes the sum (a target at the total, rounded up
    there, must not land on a weight of 0), and within the row even where its weights are NaN."""
    found = torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, cdf[:, -1:].contiguous()))
    return found.clamp_(max=cdf.shape[1] - 1)
