"""What a request asks of the Engine: its generation options (``SamplingParams``, checked when it
is submitted) and what it gets back with each token beside the token itself (``TokenLogprobs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping
from typing import Sequence as Seq

from .errors import InvalidRequestError
from .penalties import MAX_BIAS, MAX_PENALTY, REPETITION_PENALTY_RANGE
from .sampling import MIN_TEMPERATURE

MAX_LOGPROBS = 20  # top alternatives a request may ask for (as OpenAI's API)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as vLLM's; a generator takes seed + sample number


@dataclass(frozen=True)
class SamplingParams:
    """Generation options, named as in transformers' ``GenerationConfig`` (and as OpenAI's API names
    the penalties and bias it adds; see ``flexpage.penalties``)."""

    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0  # sampled rows: below MIN_TEMPERATURE (0.01) it is raised to that, as in vLLM
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | Seq[int] | None = None  # None: the model's generation_config.eos_token_id
    num_return_sequences: int = 1  # samples of the prompt; they share its pages (copy-on-write)
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives (0-20)
    repetition_penalty: float = 1.0  # in [0.01, 100]; 1: none
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logit_bias: Mapping[int, float] | None = None  # token id -> bias in [-100, 100]
    min_new_tokens: int = 0  # no stop token before this many new tokens

    def check(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            raise InvalidRequestError(f"num_return_sequences must be a positive int, got {self.num_return_sequences!r}")
        if not 0 < self.temperature < float("inf"):
            raise InvalidRequestError(f"temperature must be finite and > 0 (sampling raises it to at least "
                                      f"{MIN_TEMPERATURE}), got {self.temperature}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise InvalidRequestError(f"seed must be an int in the int64 range [{SEED_RANGE[0]}, {SEED_RANGE[1]}], "
                                      f"got {self.seed!r}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidRequestError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f"min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                                      f"got {self.min_new_tokens!r}")
        bad = [b for b in (self.logit_bias or {}).values() if not -MAX_BIAS <= b <= MAX_BIAS]
        if bad:
            raise InvalidRequestError(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bad[0]}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits before the pick."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_new_tokens)

    def stop_tokens(self) -> frozenset[int]:
        eos = self.eos_token_id
        return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (before sampling warpers) and the
    ``SamplingParams.logprobs`` most likely tokens at that position, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step produced for one output (``Engine.step`` returns one per output it advanced)."""

    index: int  # the output's index (request index + sample number)
    token: int | None  # None: the request failed (``error``), already aborted
    finish_reason: str | None  # "stop" (a stop token), "length", "error"; None while it runs
    logprobs: TokenLogprobs | None = None  # when the request asks for them
    cached_tokens: int | None = None  # with its first token: prompt tokens served from the prefix cache
    first_token_seconds: float | None = None  # with its first token: seconds from submission
    error: str | None = None  # why the request failed
