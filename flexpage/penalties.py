"""Logit adjustments a request may ask for before its next token is picked.

``logit_bias`` (OpenAI's: added to chosen tokens' logits), ``repetition_penalty`` (transformers'
and vLLM's: every token already in the prompt or the output has its logit divided by the penalty
when positive, multiplied when negative), and OpenAI's ``presence_penalty`` / ``frequency_penalty``
(subtracted once per token that the output holds, and once per occurrence; the prompt does not
count, as in OpenAI's API and vLLM). They apply in that order — the bias before the repetition
penalty as ``generate()``'s processors do, the repetition penalty before presence and frequency as
vLLM does — to a float row; greedy picks and the sampling warpers (temperature, top-k, top-p) then
see the adjusted row. Log-probabilities reported to the caller stay the model's own.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from .pages import host_tensor

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_BIAS = 100.0  # |logit_bias| values at most (OpenAI's range)


def adjust_logits(row: Tensor, tokens: Sequence[int], prompt_len: int, repetition_penalty: float = 1.0,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  logit_bias: Mapping[int, float] | None = None) -> None:
    """Adjust ``row`` (one float row of logits over the vocabulary) in place for a sequence whose
    ``tokens`` are its prompt (the first ``prompt_len``) followed by its output so far."""
    device = row.device
    if logit_bias:
        row[host_tensor(list(logit_bias), device)] += torch.tensor(list(logit_bias.values()), device=device)
    if repetition_penalty != 1.0:
        seen = host_tensor(sorted(set(tokens)), device)
        scores = row[seen]
        row[seen] = torch.where(scores < 0, scores * repetition_penalty, scores / repetition_penalty)
    output = tokens[prompt_len:]
    if output and (presence_penalty or frequency_penalty):
        ids, counts = host_tensor(output, device).unique(return_counts=True)
        row[ids] -= frequency_penalty * counts + presence_penalty
