"""Engine: many requests over one paged pool, with continuous batching and ragged steps.

A step is a loop over three parts: the ``Scheduler`` picks the sequences and their token counts
(a decode token for every running sequence that has finished its prompt, prefill chunks of
others), the ``ModelRunner`` runs them as one packed forward (no padding between sequences)
and picks their next tokens, and the Engine appends them, finishes what ended and keeps the
records and stats. Requests enter here, checked, and under tensor parallelism every rank takes
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

from .block_manager import BlockManager
from .errors import InvalidRequestError, RequestFailedError
from .hf import paged_state, wrap
from .model_runner import ModelRunner
from .parallel import RankSync
from .requests import (EngineStats, SamplingParams, StepOutput, StepSummary, TokenLogprobs, checked_prompt,
                       per_prompt_params)
from .scheduler import Scheduler, Sequence

HISTORY_STEPS = 10_000  # steps ``Engine.history`` keeps, the latest: a server steps for days


class Engine:
    """Serve many token-id prompts from one paged KV cache of ``max_cached_tokens`` tokens.

    ``max_batch_size`` sequences run at once; a step feeds at most ``max_tokens_per_step``
    tokens (decode tokens plus prefill chunks). The model is wrapped with ``flexpage.wrap``
    (its ``generate()`` is paged too; don't call it while the engine is serving). With
    ``warmup`` (the default) every step shape is compiled when the engine is built
    (``warmup()``), so serving never waits on a compile.

    Under tensor parallelism (a model loaded with transformers' ``DistributedConfig``) build the
    engine on every rank; requests enter on rank 0, which broadcasts them (over ``tp_group``, a
    gloo group by default) so every rank takes the same steps; the other ranks call ``follow()``
    until rank 0 calls ``close()``. ``check_ranks`` compares every step's plan across ranks.
    ``few_row_linears`` and ``pack_weights`` are ``wrap``'s options (CPU linear layers through the
    GEMM measured fastest; a packed copy of the weights for oneDNN, faster at many rows). The
    engine packs by default (``None``) when the copy needs at most a quarter of the memory
    available, as a server takes its KV pool up front; ``stats().packed_weight_bytes`` says what
    it holds, ``pack_weights=False`` keeps one copy of the weights.
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
        tp_group: Any = None,
        check_ranks: bool = False,
        few_row_linears: bool = True,
        pack_weights: bool | None = None,
    ) -> None:
        self.model = wrap(model, page_size=page_size, max_cached_tokens=max_cached_tokens,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len, few_row_linears=few_row_linears,
                          pack_weights=pack_weights)
        state = paged_state(self.model)
        self.cache = state.cache
        self.tokenizer = tokenizer
        self.runner = ModelRunner(self.model, self.cache, state.cache_argument, max_batch_size, max_tokens_per_step)
        self.blocks = BlockManager(self.cache, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_tokens_per_step, self.runner.chunk_block)
        self.warmup_seconds = 0.0
        self._next_index = 0
        self.ranks = RankSync.for_model(self.model, tp_group, check_ranks)
        self._closed = False
        self.reset_stats()
        if warmup:
            self.warmup()

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt + output) one request may hold in this cache."""
        return self.blocks.max_seq_len

    @property
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_work

    @property
    def preemptions(self) -> int:
        """Sequences preempted so far (pages freed, recomputed later)."""
        return self.scheduler.preemptions

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
            raise InvalidRequestError(
                f"num_return_sequences={params.num_return_sequences} exceeds max_batch_size={self.scheduler.max_batch_size}"
            )
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
        self.runner.add(index, params)
        seq = Sequence(index, tokens, len(tokens), params.max_new_tokens, params.stop_tokens(),
                       arrival=time.perf_counter(), forks=params.num_return_sequences - 1)
        self.scheduler.add(seq)
        return index

    def stream(self, prompts: Seq[Seq[int] | str], max_new_tokens: int | Seq[int] = 16,
               **sampling: Any) -> Iterator[tuple[int, int]]:
        """Serve ``prompts`` (all validated before any runs) and yield ``(output index, token)``
        as tokens are produced. ``max_new_tokens`` may be one value or one per prompt; other
        options (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``eos_token_id``, ``num_return_sequences``) apply to every prompt. With
        ``num_return_sequences=n`` sample ``j`` of prompt ``i`` is output ``i * n + j``, as in
        ``generate()``. Closing the stream early cancels its unfinished requests (pages freed)."""
        params = self._params(prompts, max_new_tokens, sampling)
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
                bar.update(self._finished - bar.n)
        return outputs

    def abort(self, indices: Collection[int]) -> list[int]:
        """Cancel requests by output index (all ``n`` outputs of a request to cancel it whole):
        their pages are freed at once. Returns the indices that were still queued or running."""
        if self.ranks is not None and self.ranks.leader:
            self.ranks.send(("abort", list(indices)))
        return self._drop(indices)

    def _drop(self, indices: Collection[int]) -> list[int]:
        """Remove outputs from the scheduler (pages freed) and forget their sampling settings."""
        dropped = self.scheduler.abort(lambda seq: seq.index in indices)
        self.runner.forget(indices)
        return dropped

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
            self._seconds += time.perf_counter() - start

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
        if self.ranks is not None:
            if self._closed:
                raise RuntimeError("this tensor-parallel engine was closed: its other ranks no longer follow")
            self._sync()
            if self._closed:
                return []
        batch = self.scheduler.schedule()
        if self.ranks is not None:
            self.ranks.compare((tuple(s.index for s in batch.decode), tuple((s.index, n) for s, n in batch.chunks)))
        if not batch:
            return []
        try:
            forward = self.runner.forward(batch)  # a failure raises StepFailedError
        except BaseException:
            self.scheduler.rollback(batch)
            raise
        picks = self.scheduler.computed(batch, forward.sampled)  # each sequence with its row of the logits
        tokens, logprobs, failed = self.runner.pick(forward.logits, picks)
        records = [StepOutput(seq.index, None, "error", error=failed[seq.index]) if token is None
                   else self._append(seq, token, logprobs.get(seq.index)) for (seq, _), token in zip(picks, tokens)]
        if failed:  # every rank fails the same rows (same logits, same seeds): no broadcast
            self._drop(failed)
        self._record(batch, forward, len(records) - len(failed))
        self._host_seconds += time.perf_counter() - step_start - forward.seconds
        return records

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        """A sequence's new token, and its end (pages freed) if the token ends it."""
        seq.append(token)
        first = len(seq.tokens) == seq.prompt_len + 1
        reason = None
        if seq.finished:
            reason = "stop" if token in seq.stop_token_ids else "length"
            self.scheduler.finish(seq)
            self.runner.forget([seq.index])
            self._finished += 1
        return StepOutput(seq.index, token, reason, logprobs, seq.cached_tokens if first else None,
                          time.perf_counter() - seq.arrival if first else None)

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every ``(decode_len, chunk_len)`` region size a step can have that compiles a graph
        (``ModelRunner.step_shapes``)."""
        return self.runner.step_shapes()

    def warmup(self, progress: bool = True) -> float:
        """Compile every step shape (``step_shapes``) now, so that no request ever waits on a
        compile; returns the seconds it took (also in ``stats()``). The pool, the prefix cache and
        the counters are as they were."""
        self.warmup_seconds += self.runner.warmup(progress)
        return self.warmup_seconds

    def stats(self) -> EngineStats:
        linears = getattr(paged_state(self.model), "linears", None)  # None once the model is unwrapped
        return EngineStats(
            steps=self._steps,
            forward_launches=self._steps,
            attention_calls=self._attention_calls,
            compiled_shapes=len(self._shapes),
            preemptions=self.scheduler.preemptions,
            peak_pages_used=self._peak_pages,
            kv_utilisation=self._utilisation_sum / self._steps if self._steps else 1.0,
            prompt_tokens_computed=self._prefill_tokens,
            prefix_hit_tokens=self.blocks.hit_tokens - self._hits_at_reset,
            tokens_generated=self._generated,
            seconds=self._seconds,
            warmup_seconds=self.warmup_seconds,
            host_ms_per_step=self._host_seconds / self._steps * 1e3 if self._steps else 0.0,
            packed_weight_bytes=linears.packed_bytes if linears else 0,
        )

    def _checked(self, prompt: Seq[int] | str, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``InvalidRequestError`` saying why it cannot be served."""
        return checked_prompt(prompt, params, self.tokenizer, self.model.config.vocab_size, self.max_seq_len)

    def _params(self, prompts, max_new_tokens, sampling) -> list[SamplingParams]:
        """One SamplingParams per prompt; every prompt is checked before any is queued."""
        params = per_prompt_params(len(prompts), max_new_tokens, sampling)
        errors = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self._checked(prompt, p)
            except InvalidRequestError as error:
                errors.append(f"prompt {i}: {error}")
        if errors:
            raise InvalidRequestError("; ".join(errors))
        return params

    def reset_stats(self) -> None:
        """Start counting afresh (``stats()`` and ``history``)."""
        self._steps = self._attention_calls = self._peak_pages = 0
        self._prefill_tokens = self._generated = self._finished = 0
        self._utilisation_sum = self._seconds = self._host_seconds = 0.0
        self._shapes: set[tuple[str, int]] = set()
        self._hits_at_reset = self.blocks.hit_tokens
        self.history: deque[StepSummary] = deque(maxlen=HISTORY_STEPS)

    def _record(self, batch, forward, produced: int) -> None:
        stats = self.cache.stats()
        self._steps += 1
        self._attention_calls += (forward.decode_len > 0) + (forward.chunk_len > 0)
        self._shapes.update(self.runner.compiled_shapes(forward.decode_len, forward.chunk_len))
        self._peak_pages = max(self._peak_pages, stats.pages_used)
        self._utilisation_sum += stats.utilisation
        self._prefill_tokens += sum(n for _, n in batch.chunks)
        self._generated += produced
        self.history.append(StepSummary(time.perf_counter(), len(batch.decode), sum(n for _, n in batch.chunks),
                                       stats.pages_used, stats.utilisation))

