"""What goes into the Engine and what comes out: a request's generation options
(``SamplingParams``, checked when it is submitted), the record of each output a step advanced
(``StepOutput``, with its ``TokenLogprobs``), and the Engine's own records (``StepSummary`` per
step, ``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping
from typing import Sequence as Seq

from ..errors import InvalidRequestError
from .penalties import MAX_BIAS, MAX_PENALTY, REPETITION_PENALTY_RANGE
from .sampling import MIN_TEMPERATURE

if TYPE_CHECKING:
    from .structured import Grammar

MAX_LOGPROBS = 20  # top alternatives a request may ask for (as OpenAI's API)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as vLLM's; a generator takes seed + sample number


@dataclass(frozen=True)
class SamplingParams:
    """Generation options, named as in transformers' ``GenerationConfig`` (and as OpenAI's API names
    the penalties and bias it adds; see ``flexpage.engine.penalties``)."""

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
    grammar: Grammar | None = None  # structured output: every output follows it (``Engine.grammar``)

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
    finish_reason: str | None  # "stop" (a stop token, or the grammar's end), "length", "error"; None while it runs
    logprobs: TokenLogprobs | None = None  # when the request asks for them
    cached_tokens: int | None = None  # with its first token: prompt tokens served from the prefix cache
    first_token_seconds: float | None = None  # with its first token: seconds from submission
    error: str | None = None  # why the request failed



@dataclass(frozen=True)
class EngineStats:
    steps: int
    forward_launches: int  # model forwards (one per step)
    attention_calls: int  # attention calls per layer, summed over steps (one per step region)
    compiled_shapes: int  # distinct compiled region shapes used (each one graph per layer variant)
    preemptions: int
    peak_pages_used: int
    kv_utilisation: float  # live tokens / reserved page slots, averaged over steps
    prompt_tokens_computed: int
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache instead of computed
    tokens_generated: int
    seconds: float
    warmup_seconds: float  # compiling every step shape (``Engine.warmup``), outside ``seconds``
    host_ms_per_step: float  # a step's time outside the model forward (schedule, plan, sampling, bookkeeping)
    packed_weight_bytes: int  # memory of the weights' packed copies (``pack_weights``); 0 without them
    drafted_tokens: int = 0  # speculated tokens verified (``Engine(speculative=...)``)
    accepted_tokens: int = 0  # of those, the ones the model agreed with
    verifications: int = 0  # sequence-steps that verified drafts
    compiled_steps: int = 0  # steps through the compiled decode forward (``compile_decode``)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 without speculation)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a speculating sequence gained per forward: its accepted drafts and one more."""
        return 1 + self.accepted_tokens / self.verifications if self.verifications else 1.0


@dataclass(frozen=True, slots=True)
class StepSummary:
    """What one step did and how full the pool was after it (``Engine.history``: the last
    ``HISTORY_STEPS`` steps)."""

    time: float  # perf_counter() at the end of the step
    decode_tokens: int
    prefill_tokens: int
    pages_used: int
    kv_utilisation: float  # live tokens / reserved page slots
    verifications: int = 0  # sequences that verified drafts
    drafted_tokens: int = 0  # speculated tokens verified
    accepted_tokens: int = 0  # of those, the ones kept


def checked_prompt(prompt: Seq[int] | str, params: SamplingParams, tokenizer: Any, vocab_size: int,
                   max_seq_len: int) -> list[int]:
    """The prompt's token ids (a string goes through ``tokenizer``), or ``InvalidRequestError``
    saying why it cannot be served with ``params`` by a model of ``vocab_size`` tokens whose
    sequences hold at most ``max_seq_len``."""
    params.check()
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("a string prompt needs Engine(..., tokenizer=...)")
        tokens = list(tokenizer(prompt)["input_ids"])
    else:
        try:
            tokens = [int(t) for t in prompt]
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(f"a prompt is a list of token ids or a string: {error}") from None
    if not tokens:
        raise InvalidRequestError("empty prompt")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.logit_bias or {} if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(tokens) + params.max_new_tokens > max_seq_len:
        raise InvalidRequestError(
            f"prompt of {len(tokens)} tokens + max_new_tokens={params.max_new_tokens} exceeds the "
            f"{max_seq_len} tokens one sequence may hold in this cache"
        )
    return tokens


def per_prompt_params(num_prompts: int, max_new_tokens: int | Seq[int], sampling: dict[str, Any]
                      ) -> list[SamplingParams]:
    """``SamplingParams`` for each of ``num_prompts`` prompts from ``generate()``-style options:
    ``max_new_tokens`` one value or one per prompt; with a ``seed``, prompt ``i``'s samples start at
    ``seed + i * num_return_sequences`` (reproducible, not identical)."""
    unknown = set(sampling) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown sampling options {sorted(unknown)}")
    counts = [max_new_tokens] * num_prompts if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(counts) != num_prompts:
        raise InvalidRequestError(f"{len(counts)} max_new_tokens values for {num_prompts} prompts")
    sampling = dict(sampling)
    seed = sampling.pop("seed", None)
    width = sampling.get("num_return_sequences", 1)
    return [SamplingParams(max_new_tokens=n, seed=None if seed is None else seed + i * width, **sampling)
            for i, n in enumerate(counts)]


def all_checked(prompts: Seq[Seq[int] | str], params: list[SamplingParams],
                check: Callable[[Seq[int] | str, SamplingParams], Any]) -> list[SamplingParams]:
    """``params`` once ``check`` passes every prompt; else one ``InvalidRequestError`` naming each
    prompt that fails and why (so a call queues all of its prompts or none)."""
    errors = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        try:
            check(prompt, p)
        except InvalidRequestError as error:
            errors.append(f"prompt {i}: {error}")
    if errors:
        raise InvalidRequestError("; ".join(errors))
    return params
