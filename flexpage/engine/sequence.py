"""A request's record through the engine (``Sequence``) and one step's work (``Batch``).

A ``Sequence`` is the one place a request's state lives: its tokens, its sampling settings and
generator, its pages' bookkeeping (written by the block manager only), its drafts, and the
sibling samples that split off once its prompt is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .requests import SamplingParams, TokenLogprobs
from .structured import Constraint


def sample_generator(params: SamplingParams, sample: int, device: torch.device) -> torch.Generator | None:
    """The generator of sample ``sample`` of a request: None when it is greedy, seeded with
    ``seed + sample`` when a seed is given."""
    if not params.do_sample:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed + sample)
    return generator


@dataclass(eq=False)
class Sequence:
    """One output's tokens and progress; ``tokens`` is the prompt followed by the output."""

    index: int  # the output's index (the request's index + its sample number)
    tokens: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # sampled outputs draw from their own
    arrival: float = 0.0  # perf_counter() when the request was queued
    # samples 1..n-1 of the request: they get rows sharing this one's pages once its prompt is computed
    siblings: list[Sequence] = field(default_factory=list)
    finished: bool = False
    # the block manager's bookkeeping
    row: int | None = None  # page-table row while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_keys: list[bytes] = field(default_factory=list)  # content keys of the first full pages (memo)
    num_registered: int = 0  # leading pages registered in the prefix cache
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache when first admitted
    # speculation (the scheduler's)
    drafts: list[int] = field(default_factory=list)  # speculated tokens this step verifies
    draft_len: int = 0  # drafts to ask for next (0: the scheduler's most)
    draft_pause: int = 0  # steps to decode without drafts after a run of rejections
    draft_misses: int = 0  # verifications in a row that accepted nothing
    stop_token_ids: frozenset[int] = field(init=False)
    constraint: Constraint | None = field(init=False)  # where the output is in its grammar (if it has one)
    finish_reason: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stop_token_ids = self.params.stop_tokens()
        grammar = self.params.grammar
        self.constraint = None if grammar is None else grammar.constraint(self.stop_token_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still need computing (1 for a sequence in decode)."""
        return len(self.tokens) - self.num_computed

    def ends_with(self, token: int, length: int) -> str | None:
        """Why ``token``, appended as the ``length``-th token, ends the sequence: "stop" (a stop
        token, or the end of its grammar, which has taken the token), "length" (``max_new_tokens``
        reached), or None."""
        if token in self.stop_token_ids or (self.constraint and self.constraint.ended_at == length - self.prompt_len):
            return "stop"
        return "length" if length - self.prompt_len >= self.max_new_tokens else None

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.finish_reason = self.ends_with(token, len(self.tokens))
        self.finished = self.finish_reason is not None


@dataclass
class Batch:
    """One step's work: decode sequences (one token each), prefill chunks ``(sequence, tokens)``
    and speculating sequences (their last token and their ``drafts``, verified at once). Their
    slots are reserved when the batch is scheduled."""

    decode: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    verify: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks or self.verify)

    def signature(self) -> tuple:
        """What the step computes, by output index (tensor-parallel ranks compare it)."""
        return (tuple(s.index for s in self.decode), tuple((s.index, n) for s, n in self.chunks),
                tuple((s.index, tuple(s.drafts)) for s in self.verify))

    @property
    def stepped(self) -> list[Sequence]:
        """Every sequence whose tokens this step computes."""
        return self.decode + [seq for seq, _ in self.chunks] + self.verify

    def new_tokens(self) -> list[tuple[Sequence, int]]:
        """Each stepped sequence with the tokens this step computes for it."""
        return ([(seq, 1) for seq in self.decode] + list(self.chunks)
                + [(seq, 1 + len(seq.drafts)) for seq in self.verify])


@dataclass
class Pick:
    """What one sequence picked in a step: its new ``tokens`` (one; a speculating sequence's
    accepted drafts and one more), their logprobs where asked, the drafts it ``accepted``, and
    the ``error`` that failed it after those tokens. A sibling sample picks from its ``parent``'s
    row in the step its prompt is computed."""

    seq: Sequence
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    accepted: int = 0
    error: str | None = None
    parent: Sequence | None = None
