"""Structured outputs: an output held to a grammar — a JSON schema, any JSON object, a regular
expression, a choice of strings or a Lark grammar — token by token, through llguidance.

``Grammars`` compiles grammars for one tokenizer (each one validated, and cached by its spec); a
request carries its ``Grammar`` (``SamplingParams.grammar``) and each of its outputs follows it
with a ``Constraint`` of its own. In each pick a sampled row's disallowed tokens are taken out of
its logits before the draw (``allowed_tokens``, ``mask_disallowed``); a greedy row keeps its
argmax where the grammar takes it, else takes the best token its grammar allows
(``greedy_allowed``); then each output takes its picked token. The request's stop tokens are
allowed wherever the grammar may end, and an output whose grammar can take no further token ends
there ("stop"); one that reaches ``max_new_tokens`` first ends with "length", as in vLLM.
``generate()`` (stock or wrapped) follows a grammar through a ``GrammarLogitsProcessor``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from threading import Lock
from typing import Any, Collection, Sequence

import numpy as np
import torch
from torch import Tensor
from transformers import LogitsProcessor

from ..core.policy import device_policy
from ..errors import FlexpageError, InvalidRequestError
from .sampling import greedy_tokens

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # what a grammar may be given as
CACHED_GRAMMARS = 256  # compiled grammars kept per tokenizer (least recently used dropped)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a model cannot stall in whitespace


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover - a dependency; said plainly if an install lacks it
        raise InvalidRequestError("structured outputs need the llguidance package (pip install llguidance)") from None
    return llguidance


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled, validated grammar for one tokenizer (``Grammars.compile``)."""

    kind: str
    definition: str = field(repr=False)  # llguidance's grammar text
    tokenizer: Any = field(repr=False)  # llguidance's tokenizer
    start: Any = field(repr=False)  # a matcher at the grammar's start: each output gets a copy (cheaper than a new one)
    keep: np.ndarray = field(repr=False)  # ``mask_keep``: the bits of a mask that can allow a token

    def constraint(self, stop_tokens: Collection[int]) -> Constraint:
        """A fresh follower of this grammar for one output that ``stop_tokens`` end."""
        return Constraint(self, stop_tokens)


class Grammars:
    """Compiles grammars for ``tokenizer`` (a transformers fast tokenizer) over a model's
    ``vocab_size`` tokens, caching them by spec. Thread-safe: a server compiles off its engine thread."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer: Any = None  # llguidance's, made with the first grammar (a second or so for 32k tokens)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = Lock()

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _llguidance().hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def compile(self, kind: str, spec: Any = None) -> Grammar:
        """The grammar of ``kind`` given by ``spec``: ``json_schema`` (a schema, dict or JSON text),
        ``json_object`` (any JSON object; no spec), ``regex`` (a pattern), ``choice`` (a list of
        strings: exactly one of them) or ``grammar`` (Lark, or GBNF/EBNF as llama.cpp writes it).
        Raises ``InvalidRequestError`` naming the kind and what is wrong with the spec."""
        key = (kind, json.dumps(spec, sort_keys=True) if not isinstance(spec, str) else spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        definition = self._definition(kind, spec)
        start = _llguidance().LLMatcher(self.tokenizer, definition, log_level=0)
        grammar = Grammar(kind, definition, self.tokenizer, start, mask_keep(self.tokenizer, start))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _definition(self, kind: str, spec: Any) -> str:
        """llguidance's grammar text for ``spec``, validated against the tokenizer."""
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher
        try:
            if kind == "json_schema":
                if not isinstance(spec, (dict, str, bool)):
                    raise ValueError("a JSON schema is an object")
                definition = matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                definition = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif kind == "regex":
                if not isinstance(spec, str):
                    raise ValueError("a regex is a string")
                definition = matcher.grammar_from_regex(spec)
            elif kind == "choice":
                if not (isinstance(spec, list) and spec and all(isinstance(s, str) and s for s in spec)):
                    raise ValueError("a choice is a non-empty list of non-empty strings")
                definition = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
            elif kind == "grammar":
                if not isinstance(spec, str):
                    raise ValueError("a grammar is a string")
                definition = llguidance.grammar_from("grammar", spec)
            else:
                raise ValueError(f"unknown kind; one of {', '.join(KINDS)}")
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"invalid {kind}: {error}") from None
        problem = matcher.validate_grammar(definition, self.tokenizer)
        if problem:
            raise InvalidRequestError(f"invalid {kind}: {problem.strip()}")
        return definition


def mask_keep(tokenizer: Any, matcher: Any) -> np.ndarray:
    """The words of a mask (llguidance's, of ``matcher`` over ``tokenizer``) with the bits set that
    can allow a token: the vocabulary's, less the end token that stands for the grammar's end (each
    output's stop tokens take its place) and the spare bits past the vocabulary."""
    bits = np.zeros(len(matcher.compute_bitmask()) * 8, dtype=bool)
    bits[: tokenizer.vocab_size] = True
    bits[list(tokenizer.eos_tokens)] = False
    return np.packbits(bits, bitorder="little").view(np.int32)


class Constraint:
    """One output's place in its grammar: which tokens may come next (``allowed``), the tokens
    it took (``take``), and where the grammar ended the output (``ended_at``)."""

    def __init__(self, grammar: Grammar, stop_tokens: Collection[int]) -> None:
        self.matcher = grammar.start.deep_copy()
        self.stop_tokens = frozenset(stop_tokens)
        self.stop_index = np.array(sorted(self.stop_tokens), dtype=np.int64)  # as an index into a row
        self.grammar_end_tokens = frozenset(grammar.tokenizer.eos_tokens)  # what llguidance ends a grammar with
        self.end = grammar.tokenizer.eos_tokens[0]  # its bit in a mask: the grammar may end here
        self.vocab_size = grammar.tokenizer.vocab_size
        self.keep = grammar.keep
        self.taken = 0  # output tokens taken
        self.ended_at: int | None = None  # output length at which the grammar could take no more tokens
        self.stopped = False  # a stop token was taken
        self._words: np.ndarray | None = None  # ``words()`` of the current state, once computed

    def words(self) -> np.ndarray:
        """llguidance's mask of the tokens that may come next, as int32 words (token ``t``: bit
        ``t % 32`` of word ``t // 32``; its end token stands for the grammar's end): computed once
        per state."""
        if self._words is None:
            self._words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        return self._words

    def allowed(self) -> np.ndarray:
        """A boolean per vocabulary entry: may it come next? (``allowed_tokens`` of this one.)"""
        return allowed_tokens([self])[0]

    def take(self, token: int) -> None:
        """Advance past an output token (a stop token ends the output: nothing to take)."""
        if token in self.stop_tokens:
            self.stopped = True
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")
        self._words = None
        self.taken += 1
        if self.matcher.is_stopped():
            self.ended_at = self.taken

    def accepts(self, token: int) -> bool:
        """Whether ``token`` may come next (as ``allowed()[token]``, for one token): a bit of the
        mask where it was computed, else one token's check (a small part of a mask's cost)."""
        if token in self.stop_tokens:
            token = self.end  # its bit says whether the grammar may end here
        elif token in self.grammar_end_tokens or not 0 <= token < self.vocab_size:
            return False
        if self._words is not None:
            return bool(int(self._words[token >> 5]) >> (token & 31) & 1)
        return self.matcher.is_accepting() if token == self.end else self.matcher.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts from here, in order (speculative drafts)."""
        return self.matcher.validate_tokens(list(tokens))


class GrammarError(FlexpageError, RuntimeError):
    """A token was picked that its output's grammar does not allow."""


def allowed_tokens(constraints: Sequence[Constraint]) -> np.ndarray:
    """``[rows, vocab]`` booleans: which tokens may come next for each constraint, from one
    unpacking of their llguidance bit masks. The tokenizer's end-of-sequence token stands in those
    masks for the grammar's end (set where the grammar may end): each output's own stop tokens
    take its place."""
    words = np.stack([c.words() for c in constraints])
    first = constraints[0]  # one tokenizer's grammars: one end token, one vocabulary
    allowed = np.unpackbits((words & first.keep).view(np.uint8), axis=1, bitorder="little").view(bool)
    allowed = allowed[:, : first.vocab_size]
    for k in np.flatnonzero(words[:, first.end >> 5] >> (first.end & 31) & 1):
        allowed[k, constraints[k].stop_index] = True
    return allowed


def greedy_allowed(logits: Tensor, rows: Sequence[int], constraints: Sequence[Constraint]) -> list[int]:
    """The argmax of each of ``rows`` of ``logits`` (``[rows, vocab]``) over the tokens its
    constraint allows next, the lowest id among equals: a float copy of the rows, masked
    (``mask_disallowed``), then reduced (``greedy_tokens``)."""
    chosen = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
    mask_disallowed(chosen, allowed_tokens(constraints))
    return greedy_tokens(chosen)


def mask_disallowed(logits: Tensor, allowed: np.ndarray) -> None:
    """Set to -inf, in place, each row's logits (``[rows, vocab]``, float) its ``allowed`` says may not
    come next. Where the device policy samples on the host (the CPU), through NumPy: a handful of
    torch ops costs ~10x more for a few rows."""
    keep = allowed
    width = min(keep.shape[1], logits.shape[1])  # a padded LM head's extra entries are never allowed
    if device_policy(logits.device).host_sampling and logits.dtype == torch.float32:
        rows = logits.numpy()
        rows[:, width:] = -np.inf
        np.putmask(rows[:, :width], ~keep[:, :width], -np.inf)
        return
    logits[:, width:] = float("-inf")
    logits[:, :width].masked_fill_(~torch.from_numpy(keep[:, :width]).to(logits.device), float("-inf"))


class GrammarLogitsProcessor(LogitsProcessor):
    """Holds every output row of one ``generate()`` call to ``grammar`` (greedy or sampled, not
    beam search: beams reorder rows): pass it in ``logits_processor``, a fresh one per call.
    ``eos_token_id``: the tokens that end an output (the model's ``generation_config``'s)."""

    def __init__(self, grammar: Grammar, eos_token_id: int | Sequence[int] | None) -> None:
        self.grammar = grammar
        self.stop_tokens = frozenset([] if eos_token_id is None else
                                     [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.constraints: list[Constraint] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.constraints is None:  # the first step: nothing generated yet
            self.constraints = [self.grammar.constraint(self.stop_tokens) for _ in range(len(input_ids))]
        else:
            for constraint, token in zip(self.constraints, input_ids[:, -1].tolist()):
                if not constraint.stopped and constraint.ended_at is None:  # a finished row is padded
                    constraint.take(token)
        allowed = allowed_tokens(self.constraints)
        allowed[~allowed.any(1)] = True  # a finished row with no stop token: anything (generate pads it)
        scores = scores.clone()
        mask_disallowed(scores, allowed)
        return scores
