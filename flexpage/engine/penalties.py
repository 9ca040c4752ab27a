"""Logit adjustments requests may ask for before their next tokens are picked.

``logit_bias`` (OpenAI's: added to chosen tokens' logits), ``repetition_penalty`` (transformers'
and vLLM's: every token already in the prompt or the output has its logit divided by the penalty
when positive, multiplied when negative), and OpenAI's ``presence_penalty`` / ``frequency_penalty``
(subtracted once per token that the output holds, and once per occurrence; the prompt does not
count, as in OpenAI's API and vLLM). They apply in that order — the bias before the repetition
penalty as ``generate()``'s processors do, the repetition penalty before presence and frequency as
vLLM does — to float rows; then ``min_new_tokens`` (transformers'; vLLM's ``min_tokens``) takes
the stop tokens out of a row whose output is shorter. Greedy picks and the sampling warpers
(temperature, top-k, top-p) see the adjusted rows. Each kind is one indexed op over every row of
the step that asks for it.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Collection, Mapping, Protocol, Sequence

import torch
from torch import Tensor

from ..core.host import host_tensor

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_BIAS = 100.0  # |logit_bias| values at most (OpenAI's range)
# repetition_penalty within these: a factor of 100 either way still leaves every logit finite in float32
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class Penalties(Protocol):
    """What a request asks for (``flexpage.SamplingParams`` has these fields)."""

    repetition_penalty: float  # 1: none
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float] | None  # token id -> bias
    min_new_tokens: int  # 0: none


def adjust_logits(logits: Tensor, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                  params: Sequence[Penalties], stop_tokens: Sequence[Collection[int]]) -> None:
    """Adjust ``logits`` (float ``[rows, vocab]``) in place: row ``i`` for a sequence whose
    ``tokens[i]`` are its prompt (the first ``prompt_lens[i]``) followed by its output so far, and
    which ``stop_tokens[i]`` end, as ``params[i]`` asks."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        index, _ = _row_entries(logits, biased, [list(params[i].logit_bias) for i in biased])
        bias = [value for i in biased for value in params[i].logit_bias.values()]
        logits.index_put_(index, torch.tensor(bias, dtype=logits.dtype, device=logits.device), accumulate=True)
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeated:  # every token of the prompt and the output, once
        index, counts = _row_entries(logits, repeated, [list(set(tokens[i])) for i in repeated])
        penalty = _per_entry(logits, [params[i].repetition_penalty for i in repeated], counts)
        scores = logits[index]
        logits[index] = torch.where(scores < 0, scores * penalty, scores / penalty)
    counted = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty)
               and len(tokens[i]) > prompt_lens[i]]
    if counted:  # every token of the output, with its count
        occurrences = [Counter(tokens[i][prompt_lens[i]:]) for i in counted]
        index, counts = _row_entries(logits, counted, [list(c) for c in occurrences])
        times = torch.tensor([n for c in occurrences for n in c.values()], dtype=logits.dtype, device=logits.device)
        presence = _per_entry(logits, [params[i].presence_penalty for i in counted], counts)
        frequency = _per_entry(logits, [params[i].frequency_penalty for i in counted], counts)
        logits.index_put_(index, -(presence + frequency * times), accumulate=True)
    early = [i for i, p in enumerate(params) if len(tokens[i]) - prompt_lens[i] < p.min_new_tokens and stop_tokens[i]]
    if early:  # too short to stop: no stop token may be picked
        index, _ = _row_entries(logits, early, [list(stop_tokens[i]) for i in early])
        logits[index] = float("-inf")


def _row_entries(logits: Tensor, rows: list[int], tokens: list[list[int]]) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """The index of ``tokens[j]`` in row ``rows[j]`` of ``logits``, for every ``j`` at once, and
    how many entries each row has (built from flat lists: per-entry Python tuples cost far more
    for the thousands of tokens of a full batch)."""
    device = logits.device
    counts = host_tensor([len(t) for t in tokens], device)
    index = host_tensor(rows, device).repeat_interleave(counts), host_tensor(list(chain.from_iterable(tokens)), device)
    return index, counts


def _per_entry(logits: Tensor, values: list[float], counts: Tensor) -> Tensor:
    """Each row's value repeated over its ``counts`` entries."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device).repeat_interleave(counts)
