"""Engine: many requests over one paged pool, with continuous batching and ragged steps.

A step is three calls: the ``Scheduler`` picks the sequences and their token counts (a decode
token for every running sequence that has finished its prompt, prefill chunks of others) and
reserves their slots, the ``ModelRunner`` runs them as one packed forward (no padding between
sequences) and picks their next tokens, and the ``Scheduler`` appends them and finishes what
ended; the Engine keeps the records and stats. Requests enter here, checked, and under tensor parallelism every rank takes
the same steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Collection, Iterator
from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..errors import FlexpageError, InvalidRequestError, RequestFailedError
from ..hf import paged_state, wrap
from .block_manager import BlockManager
from .counters import Counters
from .model_runner import ModelRunner
from .parallel import RankSync
from .requests import (EngineStats, SamplingParams, StepOutput, StepSummary, checked_prompt,
                       all_checked, per_prompt_params)
from .scheduler import Scheduler
from .sequence import Sequence, sample_generator
from .speculative import Proposer, proposer
from .structured import Grammar, Grammars

class Engine:
    """Serve many token-id prompts from one paged KV cache of ``max_cached_tokens`` tokens.

    ``max_batch_size`` sequences run at once; a step feeds at most ``max_tokens_per_step`` tokens
    (decode tokens plus prefill chunks); one request holds at most ``max_seq_len`` tokens (default and
    limit: the model's ``max_position_embeddings``, and what the pool holds). The model is wrapped with ``flexpage.wrap`` (don't call its
    ``generate()`` while the engine serves). ``warmup`` compiles every step shape when the engine is
    built, so serving never waits on a compile, including the decode-only steps, one static step
    per decode bucket (``core.static_step``), where ``compile_decode`` asks (None: the device
    policy's choice, every bucket on the CPU, where they measured faster than eager; True: every
    bucket; False: none; the same option as ``wrap``'s).

    Under tensor parallelism (a model loaded with transformers' ``DistributedConfig``) build the
    engine on every rank; requests enter on rank 0, which broadcasts them (over ``tp_group``, gloo
    by default); the other ranks call ``follow()`` until rank 0 calls ``close()``; ``check_ranks``
    compares every step's plan across ranks. ``few_row_linears`` and ``pack_weights`` are ``wrap``'s
    (CPU linear layers through the GEMM measured fastest; oneDNN on packed copies of the weights,
    by default when they need at most a quarter of the memory available). ``kv_dtype`` is ``wrap``'s:
    the pages in the model's dtype (None) or quantised (``"int8"``, ``"float8_e4m3fn"``).

    ``speculative``: ``"ngram"`` (prompt lookup in each request's tokens), a draft model (an Engine
    of its own, ``DraftModel``) or a proposer ``(tokens, k) -> drafts``. Each decoding
    sequence then verifies up to ``num_speculative_tokens`` drafts in the step's forward and keeps
    those the model agrees with, and one token more: exactly the tokens without speculation.
    ``adaptive_speculation`` shortens and pauses drafts that keep failing (``Scheduler.settle``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        page_size: int = 16,
        max_cached_tokens: int = 32768,
        max_batch_size: int = 32,
        max_tokens_per_step: int = 512,
        max_seq_len: int | None = None,
        tokenizer: Any = None,
        prefix_caching: bool = True,
        warmup: bool = True,
        tp_group: Any = None, check_ranks: bool = False,
        few_row_linears: bool = True, pack_weights: bool | None = None,
        speculative: str | Proposer | PreTrainedModel | None = None,
        num_speculative_tokens: int = 4,
        adaptive_speculation: bool = True,
        compile_decode: bool | None = None,
        kv_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.positions = getattr(model.config, "max_position_embeddings", None)  # past them the model is untrained
        if max_seq_len is not None and self.positions and max_seq_len > self.positions:
            raise ValueError(f"max_seq_len ({max_seq_len}) exceeds the model's {self.positions} positions "
                             f"(config.max_position_embeddings)")
        self.model = wrap(model, page_size=page_size, max_cached_tokens=max_cached_tokens, max_batch_size=max_batch_size,
                          max_seq_len=max_seq_len or self.positions, few_row_linears=few_row_linears,
                          pack_weights=pack_weights, kv_dtype=kv_dtype)
        state = paged_state(self.model)
        self.cache, self.tokenizer = state.cache, tokenizer
        self.grammars = None if tokenizer is None else Grammars(tokenizer, self.model.config.vocab_size)
        self.runner = ModelRunner(self.model, self.cache, state.cache_argument, max_batch_size, max_tokens_per_step,
                                  compile_decode, state.linears,
                                  num_speculative_tokens if speculative is not None else 0)
        self.blocks = BlockManager(self.cache, prefix_caching)
        draft_options = dict(page_size=page_size, max_cached_tokens=max_cached_tokens, max_batch_size=max_batch_size,
                             max_tokens_per_step=max_tokens_per_step, max_seq_len=max_seq_len, warmup=warmup)
        drafts = proposer(speculative, num_speculative_tokens, self.model.config.vocab_size,
                          lambda draft: DraftModel(draft, **draft_options))
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_tokens_per_step, self.runner.shape.chunk_block,
                                   drafts, num_speculative_tokens, adaptive_speculation)
        self.warmup_seconds, self._next_index = 0.0, 0
        self.ranks, self._closed = RankSync.for_model(self.model, tp_group, check_ranks), False
        self.reset_stats()
        if warmup:
            self.warmup()

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt + output) one request may hold: the model's positions, or the cache's room."""
        return min(self.blocks.max_seq_len, self.positions or self.blocks.max_seq_len)

    @property
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_work

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (pages freed, recomputed later)."""
        return self.scheduler.preemptions

    def grammar(self, kind: str, spec: Any = None) -> Grammar:
        """A structured-output grammar for ``SamplingParams(grammar=...)`` (``Grammars.compile``:
        ``json_schema``, ``json_object``, ``regex``, ``choice`` or ``grammar``), compiled for the
        engine's tokenizer and cached; ``InvalidRequestError`` if the spec is invalid."""
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need Engine(..., tokenizer=...)")
        return self.grammars.compile(kind, spec)

    def queue(self) -> tuple[list[int], list[int]]:
        """Output indices of the sequences running now and of those waiting (new or preempted)."""
        return [s.index for s in self.scheduler.running], [s.index for s in self.scheduler.waiting]

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Seq[int] | str, params: SamplingParams | None = None) -> int:
        """Queue one request and return its index; raises ``InvalidRequestError`` (and queues
        nothing) for a request the engine cannot serve."""
        params = params or SamplingParams()
        if params.eos_token_id is None:  # as generate(): the model's own stop tokens by default
            params = dataclasses.replace(params, eos_token_id=self.model.generation_config.eos_token_id)
        tokens = self._checked(prompt, params)
        if params.num_return_sequences > self.scheduler.max_batch_size:
            raise InvalidRequestError(f"num_return_sequences={params.num_return_sequences} exceeds "
                                      f"max_batch_size={self.scheduler.max_batch_size}")
        if self.ranks is not None:
            if not self.ranks.leader:
                raise InvalidRequestError("under tensor parallelism requests enter on rank 0; other ranks follow()")
            if params.do_sample and params.seed is None:  # every rank must draw the same samples
                params = dataclasses.replace(params, seed=int(torch.randint(2**62, (1,))))
            self.ranks.send(("add", tokens, params))
        return self._queue(tokens, params)

    def _queue(self, tokens: list[int], params: SamplingParams) -> int:
        """Schedule a checked request; its output indices are the next ``num_return_sequences``."""
        index = self._next_index
        self._next_index += params.num_return_sequences  # sample j of the request is output index + j
        arrival, device = time.perf_counter(), self.runner.device
        seq, *siblings = [Sequence(index + j, list(tokens), len(tokens), params, sample_generator(params, j, device),
                                   arrival) for j in range(params.num_return_sequences)]
        seq.siblings = siblings
        self.scheduler.add(seq)
        return index

    def stream(self, prompts: Seq[Seq[int] | str], max_new_tokens: int | Seq[int] = 16,
               **sampling: Any) -> Iterator[tuple[int, int]]:
        """Serve ``prompts`` (all validated before any runs) and yield ``(output index, token)``
        as tokens are produced. ``max_new_tokens`` may be one value or one per prompt; other
        options (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``eos_token_id``, ``num_return_sequences``, ``grammar``, ...) apply to every prompt. With
        ``num_return_sequences=n`` sample ``j`` of prompt ``i`` is output ``i * n + j``, as in
        ``generate()``. Closing the stream early cancels its unfinished requests (pages freed)."""
        params = all_checked(prompts, per_prompt_params(len(prompts), max_new_tokens, sampling), self._checked)
        first = self._next_index
        for prompt, p in zip(prompts, params):
            self.add_request(prompt, p)
        mine = range(first, self._next_index)
        try:
            for record in self.run():
                if record.index in mine:
                    yield record.index - first, record.token
        finally:  # a consumer that stops early cancels what is left of its requests
            self.abort(mine)

    def generate(self, prompts: Seq[Seq[int] | str], max_new_tokens: int | Seq[int] = 16,
                 progress: bool = False, **sampling: Any) -> list[list[int]]:
        """The generated token ids of each output, in input order (see ``stream``)."""
        outputs: list[list[int]] = [[] for _ in range(len(prompts) * sampling.get("num_return_sequences", 1))]
        with tqdm(total=len(outputs), desc="requests", unit="req", disable=not progress) as bar:
            for i, token in self.stream(prompts, max_new_tokens, **sampling):
                outputs[i].append(token)
                bar.update(self.counters.finished - bar.n)
        return outputs

    def abort(self, indices: Collection[int]) -> list[int]:
        """Cancel requests by output index (all ``n`` outputs of a request to cancel it whole):
        their pages are freed at once. Returns the indices that were still queued or running."""
        if self.ranks is not None and self.ranks.leader:
            self.ranks.send(("abort", list(indices)))
        return self._drop(indices)

    def _drop(self, indices: Collection[int]) -> list[int]:
        """Remove outputs from the scheduler (pages freed)."""
        return self.scheduler.abort(lambda seq: seq.index in indices)

    def run(self) -> Iterator[StepOutput]:
        """Step until every queued request has finished, yielding each step's records of tokens;
        raises ``RequestFailedError`` after a step in which a request failed (the others stay queued)."""
        start = time.perf_counter()
        try:
            while self.scheduler.has_work:
                records = self.step()
                yield from (r for r in records if r.token is not None)
                failed = [f"request {r.index}: {r.error}" for r in records if r.error is not None]
                if failed:
                    raise RequestFailedError("; ".join(failed))
        finally:
            self.counters.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ tensor parallelism
    def follow(self) -> dict[int, list[int]]:
        """On a rank other than 0: take every step rank 0 takes until it calls ``close()``;
        returns each request's tokens (the same as rank 0's)."""
        if self.ranks is None or self.ranks.leader:
            raise RuntimeError("follow() is for ranks other than 0 of a tensor-parallel engine")
        outputs: dict[int, list[int]] = {}
        while not self._closed:
            for record in self.step():
                if record.token is not None:
                    outputs.setdefault(record.index, []).append(record.token)
        return outputs

    def close(self) -> None:
        """On rank 0 of a tensor-parallel engine: let the other ranks' ``follow()`` return."""
        if self.ranks is not None and self.ranks.leader and not self._closed:
            self.ranks.send(("close",))
            self._sync()

    def _synced(self) -> bool:
        """Before a tensor-parallel step: take rank 0's commands; False once it has closed."""
        if self._closed:
            raise RuntimeError("this tensor-parallel engine was closed: its other ranks no longer follow")
        self._sync()
        return not self._closed

    def _sync(self) -> None:
        """Exchange rank 0's commands; the other ranks apply them (rank 0 already has)."""
        for command, *args in self.ranks.exchange():
            if command == "close":
                self._closed = True
            elif not self.ranks.leader and command == "add":
                self._queue(*args)
            elif not self.ranks.leader and command == "abort":
                self.abort(*args)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one ragged step; return what it produced for each output it advanced: a token (with
        its finish reason, the logprobs asked for and, with a first token, the prefix-cache hits and
        time to it), or the error that failed the request (already aborted, its pages freed)."""
        step_start = time.perf_counter()
        if self.ranks is not None and not self._synced():
            return []
        batch = self.scheduler.schedule()  # rows and slots reserved
        if self.ranks is not None:
            self.ranks.compare(batch.signature())
        if not batch:
            return []
        try:
            result = self.runner.run(batch)  # a failed forward raises StepFailedError
        except BaseException:
            self.scheduler.rollback(batch)
            raise
        records = self.scheduler.postprocess(batch, result.picks)  # every rank fails the same requests
        self.counters.step(batch, result, records, self.cache.stats(), self.runner.compiled_shapes(
            result.decode_len, result.chunk_len), step_start)
        return records

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every ``(decode_len, chunk_len)`` region size that compiles a graph (``ModelRunner.step_shapes``)."""
        return self.runner.step_shapes()

    def warmup(self, progress: bool = True) -> float:
        """Compile every step shape (``step_shapes``) now, so that no request ever waits on a
        compile; returns the seconds it took (also in ``stats()``). The pool, the prefix cache and
        the counters are as they were."""
        self.warmup_seconds += self.runner.warmup(self.blocks, progress)
        return self.warmup_seconds

    def stats(self) -> EngineStats:
        linears = getattr(paged_state(self.model), "linears", None)  # None once the model is unwrapped
        c = self.counters
        return EngineStats(
            steps=c.steps,
            forward_launches=c.steps,
            attention_calls=c.attention_calls,
            compiled_shapes=len(c.shapes),
            preemptions=self.scheduler.preemptions,
            peak_pages_used=c.peak_pages,
            kv_utilisation=c.utilisation_sum / c.steps if c.steps else 1.0,
            prompt_tokens_computed=c.prefill_tokens,
            prefix_hit_tokens=self.blocks.hit_tokens - c.prefix_hits_at_reset,
            tokens_generated=c.generated,
            seconds=c.seconds,
            warmup_seconds=self.warmup_seconds,
            host_ms_per_step=c.host_seconds / c.steps * 1e3 if c.steps else 0.0,
            packed_weight_bytes=linears.packed_bytes if linears else 0,
            drafted_tokens=c.drafted,
            accepted_tokens=c.accepted,
            verifications=c.verifications,
            compiled_steps=self.runner.compiled_steps - c.compiled_steps_at_reset,
        )

    def _checked(self, prompt: Seq[int] | str, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``InvalidRequestError`` saying why it cannot be served."""
        return checked_prompt(prompt, params, self.tokenizer, self.model.config.vocab_size, self.max_seq_len)

    def reset_stats(self) -> None:
        """Start counting afresh (``stats()`` and ``history``)."""
        self.counters = Counters(self.blocks.hit_tokens, self.runner.compiled_steps)

    @property
    def history(self) -> deque[StepSummary]:
        """What each of the latest steps did (``StepSummary``), oldest first."""
        return self.counters.history


class DraftModel:
    """Drafts from a smaller model with the target's vocabulary: an ``Engine`` of its own (its own
    pool; prefix caching, so each step recomputes only its sequences' tokens since their last full
    cached page), run for every speculating sequence at once, ``k`` greedy tokens each.

    ``options`` are the draft Engine's (``max_cached_tokens`` should hold the target's running
    sequences: the target Engine passes its own)."""

    def __init__(self, model: PreTrainedModel, **options: Any) -> None:
        self.engine = Engine(model, **options)

    def __call__(self, asks: list[tuple[Seq[int], int]]) -> list[list[int]]:
        indices = [self.engine.add_request(list(tokens), SamplingParams(max_new_tokens=k, eos_token_id=[]))
                   for tokens, k in asks]
        drafts: dict[int, list[int]] = {index: [] for index in indices}
        try:
            for record in self.engine.run():
                drafts[record.index].append(record.token)
        except FlexpageError:  # a draft that fails costs only its speculation: keep what was drafted
            self.engine.abort(indices)
        return [drafts[index] for index in indices]
