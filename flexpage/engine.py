"""Engine: many requests over one paged pool, with continuous batching and ragged steps.

Each step is one forward of the model over a packed batch: a decode token for every
running sequence that has finished its prompt, then prefill chunks of others, no padding
between sequences (``PageTable.plan_packed``). The step's ``PackedBlockMask`` is built
once from the page tables and every layer attends through it. Attention's region sizes are
bucketed (powers of two), so a few compiled attention graphs serve every mix of lengths; the
linear layers see each decode token once (17 decode tokens are 17 rows, not a bucket of 32).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Mapping
from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .attention import sdpa_over_pages
from .errors import InvalidRequestError, OutOfPagesError, RequestFailedError, StepFailedError
from .hf import wrap
from .masks import PackedBlockMask
from .pages import cdiv, host_tensor
from .parallel import RankSync
from .penalties import MAX_BIAS, MAX_PENALTY, REPETITION_PENALTY_RANGE, adjust_logits
from .sampling import MIN_TEMPERATURE, Sampler, greedy_tokens
from .scheduler import Scheduler, Sequence

# query block of prefill chunks where FlexAttention attends them (Triton's smallest tile); where SDPA
# attends each chunk on its own (CPU) chunks need no alignment. Decode tokens are one-token rows.
CHUNK_BLOCK = 16
MIN_CHUNK_REGION = 64  # the smallest chunk-region bucket
MAX_LOGPROBS = 20  # top alternatives a request may ask for (as OpenAI's API)
HISTORY_STEPS = 10_000  # steps ``Engine.history`` keeps, the latest: a server steps for days
REQUEST_RECORDS = 100_000  # outputs the per-request records keep, the latest (``Engine.reset_stats``)
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


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did and how full the pool was after it (``Engine.history``: the last
    ``HISTORY_STEPS`` steps)."""

    time: float  # perf_counter() at the end of the step
    decode_tokens: int
    prefill_tokens: int
    pages_used: int
    kv_utilisation: float  # live tokens / reserved page slots


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
        if max_tokens_per_step < max_batch_size + CHUNK_BLOCK:
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must leave room for a decode token per sequence "
                f"(max_batch_size={max_batch_size}) and one {CHUNK_BLOCK}-token prefill chunk"
            )
        self.model = wrap(model, page_size=page_size, max_cached_tokens=max_cached_tokens,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len, few_row_linears=few_row_linears,
                          pack_weights=pack_weights)
        self.cache = model._flexpage.cache
        self.tokenizer = tokenizer
        softcap = getattr(model.config, "attn_logit_softcapping", None)
        self._device = self.model.device  # fixed once the pools are allocated (the property costs ~50 us a call)
        # a lone decode token and each prefill chunk take SDPA over their pages: they compile nothing
        self._sdpa = sdpa_over_pages(self._device, softcap, 1)
        self.chunk_block = 1 if self._sdpa else CHUNK_BLOCK  # unaligned chunks: no padding rows in the forward
        self.scheduler = Scheduler(self.cache, max_batch_size, max_tokens_per_step, self.chunk_block, prefix_caching)
        self.warmup_seconds = 0.0
        self._sampling: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}
        self._sampler = Sampler()  # keeps its scratch rows from step to step
        self._next_index = 0
        self.ranks = RankSync.for_model(self.model, tp_group, check_ranks)
        self._closed = False
        self.reset_stats()
        if warmup:
            self.warmup()

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt + output) one request may hold in this cache."""
        pt = self.cache.page_table
        return min(pt.num_pages, pt.max_pages_per_seq) * pt.page_size

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
        for j in range(params.num_return_sequences):
            self._sampling[index + j] = (params, self._generator(params, j))
        seq = Sequence(index, tokens, len(tokens), params.max_new_tokens, params.stop_tokens(),
                       arrival=time.perf_counter(), forks=params.num_return_sequences - 1)
        self.scheduler.add(seq)
        return index

    def _generator(self, params: SamplingParams, sample: int) -> torch.Generator | None:
        if not params.do_sample:
            return None
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed + sample)
        return generator

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
            for index, token in self.run():
                if index in mine:
                    yield index - first, token
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
        for index in indices:
            self._sampling.pop(index, None)
        return dropped

    def run(self) -> Iterator[tuple[int, int]]:
        """Step until every queued request has finished, yielding ``(request index, token)``;
        raises ``RequestFailedError`` after a step in which a request failed (the others stay queued)."""
        start = time.perf_counter()
        try:
            while self.scheduler.has_work:
                yield from self.step()
                if self.failed:
                    raise RequestFailedError("; ".join(f"request {i}: {why}" for i, why in self.failed.items()))
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
            for index, token in self.step():
                outputs.setdefault(index, []).append(token)
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
    def step(self) -> list[tuple[int, int]]:
        """Run one ragged step; return the ``(request index, token)`` pairs it produced. Requests
        that failed after the forward are in ``failed`` (index -> reason) until the next step,
        already aborted."""
        step_start = time.perf_counter()
        self.failed = {}
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
        decode_len = self._decode_len(len(batch.decode))
        block = self.chunk_block
        aligned = sum(cdiv(n, block) * block for _, n in batch.chunks)
        chunk_len = aligned if self._sdpa or not aligned else _bucket(aligned, MIN_CHUNK_REGION)  # buckets: graphs
        plan = self.cache.begin_packed_step(
            [s.row for s in batch.decode], [(s.row, n) for s, n in batch.chunks], decode_len, chunk_len, block
        )
        ids = [seq.tokens[-1] for seq in batch.decode]  # not padded to decode_len: attention pads its rows
        keep, sampled = list(range(len(batch.decode))), list(batch.decode)  # positions whose logits pick a token
        for seq, n in batch.chunks:
            span = cdiv(n, block) * block
            ids += seq.tokens[seq.num_computed : seq.num_computed + n] + [0] * (span - n)
            if seq.num_computed + n == len(seq.tokens):  # the chunk ends the prompt: its last logit samples
                keep.append(len(ids) - span + n - 1)
                sampled.append(seq)
        ids += [0] * (plan.q_len - len(ids))
        try:
            logits, model_seconds = self._forward(ids, plan, keep)
        except BaseException as error:  # the step's tokens were never computed: give their slots back
            stepped = batch.decode + [seq for seq, _ in batch.chunks]
            for seq in stepped:
                self.cache.page_table.truncate(seq.row, seq.num_computed)
            if isinstance(error, Exception):
                raise StepFailedError([seq.index for seq in stepped], error) from error
            raise
        for seq in batch.decode:
            seq.num_computed += 1
        for seq, n in batch.chunks:
            seq.num_computed += n
        for seq in batch.decode + [seq for seq, _ in batch.chunks]:
            self.scheduler.register_pages(seq)
        produced = []
        picks = list(self._with_forks(sampled))  # each sequence with its row of the logits
        tokens, self.step_logprobs, self.failed = self._pick(logits, picks)
        for (seq, _), token in zip(picks, tokens):
            if token is None:  # failed: dropped below
                continue
            seq.append(token)
            if len(seq.tokens) == seq.prompt_len + 1:  # its first token
                self.first_token_seconds[seq.index] = time.perf_counter() - seq.arrival
                self.cached_prompt_tokens[seq.index] = seq.cached_tokens
            produced.append((seq.index, token))
            if seq.finished:
                self.finish_reasons[seq.index] = "stop" if token in seq.stop_token_ids else "length"
                self.scheduler.finish(seq)
                del self._sampling[seq.index]
                self._finished += 1
        if self.failed:  # every rank fails the same rows (same logits, same seeds): no broadcast
            self._drop(self.failed)
        self._record(batch, decode_len, chunk_len, len(produced))
        self._host_seconds += time.perf_counter() - step_start - model_seconds
        return produced

    def _forward(self, ids: list[int], plan, keep: list[int]) -> tuple[torch.Tensor, float]:
        """One forward over a packed step: the logits of the ``keep`` positions, and the seconds
        the model itself took (building its inputs and mask is host work)."""
        device = self._device
        inputs = dict(
            input_ids=host_tensor(ids, device).view(1, -1),
            position_ids=plan.position_ids,  # the plan's tensors are on the cache's device already
            attention_mask=PackedBlockMask.for_step(self.cache.page_table, plan),
            use_cache=True,
            # every position's logits (0) when all are kept: a pure decode step builds no index tensor
            logits_to_keep=0 if len(keep) == len(ids) else host_tensor(keep, device),
        )
        start = time.perf_counter()
        logits = self.model(**inputs, **{self.model._flexpage.cache_argument: self.cache}).logits[0]
        return logits, time.perf_counter() - start

    def _decode_len(self, count: int) -> int:
        """The decode attention call's rows: a lone decode token attended eagerly takes one
        (nothing compiled depends on it), else a power of two >= 2, so compiled graphs are few
        (the rows past the real tokens are empty: they cost attention little and the rest of the
        forward nothing)."""
        if count == 0 or count == 1 and self._sdpa:
            return count
        return _bucket(count, 2)

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every ``(decode_len, chunk_len)`` region size a step can have that compiles a graph:
        each chunk-region bucket and each decode-region bucket. Where SDPA attends a lone decode
        token and the prefill chunks (CPU), those regions compile nothing and have no buckets."""
        chunks = []
        if not self._sdpa:
            chunks.append(MIN_CHUNK_REGION)
            while chunks[-1] < self.scheduler.max_tokens_per_step:
                chunks.append(chunks[-1] * 2)
        first = 2 if self._sdpa else 1
        decodes = sorted({self._decode_len(k) for k in range(first, self.scheduler.max_batch_size + 1)})
        return [(0, c) for c in chunks] + [(d, 0) for d in decodes]

    @torch.inference_mode()
    def warmup(self, progress: bool = True) -> float:
        """Compile every step shape the engine can use (``step_shapes``) now, so that no
        request ever waits on a compile; returns the seconds it took (also in ``stats()``).

        Each shape runs one forward over scratch rows (zeros as tokens), keeping every decode
        row's logits (so the linear layers start timing their kernels for these row counts
        here), then the rows are freed:
        the pool, the prefix cache and the counters are as they were. A chunk region is warmed
        with two chunks, since a lone chunk is attended by SDPA and compiles nothing.
        """
        start = time.perf_counter()
        pt = self.cache.page_table
        for decode_len, chunk_len in tqdm(self.step_shapes(), desc="warm-up", unit="shape", disable=not progress):
            free = len(pt.free_pages) - decode_len - 1  # truly free pages: cached prefix pages stay
            tokens = min(chunk_len, self.chunk_block + min(free, pt.max_pages_per_seq) * pt.page_size)
            if free < 0 or chunk_len and tokens <= self.chunk_block:
                raise OutOfPagesError(f"warm-up needs free pages for a step of shape {(decode_len, chunk_len)}: "
                                      f"call it while the engine is idle")
            split = self.scheduler.max_batch_size > 1  # two chunks where two rows may run
            decoding = min(decode_len, self.scheduler.max_batch_size)  # a bucket may exceed the rows
            rows = [self.cache.add_sequence() for _ in range(decoding + (1 + split) * (chunk_len > 0))]
            chunks = [(rows[-1], tokens)] if chunk_len else []
            if chunk_len and split:
                chunks = [(rows[-2], self.chunk_block), (rows[-1], tokens - self.chunk_block)]
            try:
                plan = self.cache.begin_packed_step(rows[:decoding], chunks, decode_len, chunk_len, self.chunk_block)
                self._forward([0] * plan.q_len, plan, list(range(max(decoding, 1))))  # LM head: every decode row
            finally:
                for row in rows:
                    self.cache.free_sequence(row)
        self.warmup_seconds += time.perf_counter() - start
        return self.warmup_seconds

    def stats(self) -> EngineStats:
        linears = getattr(self.model._flexpage, "linears", None)  # None once the model is unwrapped
        return EngineStats(
            steps=self._steps,
            forward_launches=self._steps,
            attention_calls=self._attention_calls,
            compiled_shapes=len(self._shapes),
            preemptions=self.scheduler.preemptions,
            peak_pages_used=self._peak_pages,
            kv_utilisation=self._utilisation_sum / self._steps if self._steps else 1.0,
            prompt_tokens_computed=self._prefill_tokens,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens - self._hits_at_reset,
            tokens_generated=self._generated,
            seconds=self._seconds,
            warmup_seconds=self.warmup_seconds,
            host_ms_per_step=self._host_seconds / self._steps * 1e3 if self._steps else 0.0,
            packed_weight_bytes=linears.packed_bytes if linears else 0,
        )

    # ------------------------------------------------------------------ internals
    def _with_forks(self, sampled: list[Sequence]) -> Iterator[tuple[Sequence, int]]:
        """Each sampled sequence with its row of the step's logits; a prompt just finished with
        ``n`` samples asked for splits into its ``n - 1`` siblings here, each sampling from the
        same logits."""
        for row, seq in enumerate(sampled):
            if seq.forks and not seq.output:
                for j in range(1, seq.forks + 1):
                    yield self.scheduler.fork(seq, seq.index + j), row
                seq.forks = 0
            yield seq, row

    def _pick(self, logits: torch.Tensor, picks: list[tuple[Sequence, int]]
              ) -> tuple[list[int | None], dict[int, TokenLogprobs], dict[int, str]]:
        """Each pick's next token (None if its request failed), the logprobs asked for, and why
        each failed request failed. A row with nothing to sample from fails alone; if the step's
        penalties, sampling or logprobs raise, the picks are taken again one at a time, so only
        the requests that raise alone fail."""
        try:
            tokens = self._next_tokens(logits, picks)
            logprobs = self._logprobs(logits, picks, tokens)
        except Exception:  # noqa: BLE001 - the culprit is found below, one request at a time
            tokens, logprobs, failed = [], {}, {}
            for pick in picks:
                try:
                    (token,) = self._next_tokens(logits, [pick])
                    logprobs |= self._logprobs(logits, [pick], [token])
                except Exception as error:  # noqa: BLE001 - reported to this request alone
                    token, failed[pick[0].index] = None, f"{type(error).__name__}: {error}"
                tokens.append(token)
        else:
            failed = {}
        for (seq, _), token in zip(picks, tokens):
            if token is None and seq.index not in failed:
                failed[seq.index] = ("nothing could be sampled from the request's logits: NaN or infinite after "
                                     "its penalties and temperature")
        return tokens, logprobs, failed

    def _next_tokens(self, logits: torch.Tensor, picks: list[tuple[Sequence, int]]) -> list[int | None]:
        """Each sequence's next token from its row of ``logits`` (after the penalties and bias its
        request asks for): greedy ones by one argmax over the step, sampled ones by one draw over
        the step (``Sampler``), each from its request's generator."""
        settings = [self._sampling[seq.index] for seq, _ in picks]
        if any(params.adjusts_logits for params, _ in settings):  # a float copy, a row per sequence, to adjust
            logits = logits[host_tensor([row for _, row in picks], logits.device)].float()
            adjust_logits(logits, [seq.tokens for seq, _ in picks], [seq.prompt_len for seq, _ in picks],
                          [params for params, _ in settings], [seq.stop_token_ids for seq, _ in picks])
            picks = [(seq, i) for i, (seq, _) in enumerate(picks)]
        drawn = [i for i, (params, _) in enumerate(settings) if params.do_sample]
        greedy = greedy_tokens(logits) if len(drawn) < len(picks) else None  # the argmax of every row
        tokens = [0 if greedy is None else greedy[row] for _, row in picks]
        if drawn:
            params = [settings[i][0] for i in drawn]
            index = [picks[i][1] for i in drawn]  # no copy of the logits when every row samples
            rows = logits if index == list(range(len(logits))) else logits[host_tensor(index, logits.device)]
            sampled = self._sampler(rows, [p.temperature for p in params], [p.top_k for p in params],
                                    [p.top_p for p in params], [settings[i][1] for i in drawn])
            for i, token in zip(drawn, sampled):
                tokens[i] = token
        return tokens

    def _logprobs(self, logits: torch.Tensor, picks: list[tuple[Sequence, int]],
                  tokens: list[int]) -> dict[int, TokenLogprobs]:
        """The log-probabilities the step's requests asked for (``SamplingParams.logprobs``), by
        sequence index: one log-softmax and one top-k over all of their rows."""
        asked = [(seq.index, row, token, top) for (seq, row), token in zip(picks, tokens)
                 if token is not None and (top := self._sampling[seq.index][0].logprobs) is not None]
        if not asked:
            return {}
        device = logits.device
        logprobs = logits[host_tensor([row for _, row, _, _ in asked], device)].float().log_softmax(-1)
        chosen = logprobs.gather(1, host_tensor([token for _, _, token, _ in asked], device)[:, None])[:, 0].tolist()
        width = max(top for *_, top in asked)
        values, ids = logprobs.topk(width) if width else (logprobs[:, :0], logprobs[:, :0].long())
        values, ids = values.tolist(), ids.tolist()
        return {index: TokenLogprobs(chosen[i], list(zip(ids[i][:top], values[i][:top])))
                for i, (index, _, _, top) in enumerate(asked)}

    def _checked(self, prompt: Seq[int] | str, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``InvalidRequestError`` saying why it cannot be served."""
        params.check()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a string prompt needs Engine(..., tokenizer=...)")
            tokens = list(self.tokenizer(prompt)["input_ids"])
        else:
            try:
                tokens = [int(t) for t in prompt]
            except (TypeError, ValueError) as error:
                raise InvalidRequestError(f"a prompt is a list of token ids or a string: {error}") from None
        if not tokens:
            raise InvalidRequestError("empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.logit_bias or {} if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(tokens) + params.max_new_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt of {len(tokens)} tokens + max_new_tokens={params.max_new_tokens} exceeds the "
                f"{self.max_seq_len} tokens one sequence may hold in this cache"
            )
        return tokens

    def _params(self, prompts, max_new_tokens, sampling) -> list[SamplingParams]:
        """One SamplingParams per prompt; every prompt is checked before any is queued."""
        unknown = set(sampling) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown sampling options {sorted(unknown)}")
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(counts) != len(prompts):
            raise InvalidRequestError(f"{len(counts)} max_new_tokens values for {len(prompts)} prompts")
        seed = sampling.pop("seed", None)  # output k samples from seed + k: reproducible, not identical
        width = sampling.get("num_return_sequences", 1)
        params = [
            SamplingParams(max_new_tokens=n, seed=None if seed is None else seed + i * width, **sampling)
            for i, n in enumerate(counts)
        ]
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
        """Start counting afresh (``stats()``, ``history``, the per-request records). The
        per-request records (``first_token_seconds``, ``cached_prompt_tokens``,
        ``finish_reasons``) keep the latest ``REQUEST_RECORDS`` outputs, so a long-lived engine's
        memory stays bounded; ``flexpage serve`` pops each request's entries once it is done."""
        self._steps = self._attention_calls = self._peak_pages = 0
        self._prefill_tokens = self._generated = self._finished = 0
        self._utilisation_sum = self._seconds = self._host_seconds = 0.0
        self._shapes: set[tuple[str, int]] = set()
        self._hits_at_reset = self.scheduler.prefix_hit_tokens
        # request index -> seconds from submission; prompt tokens from the prefix cache; "stop" (a stop
        # token) or "length"
        self.first_token_seconds: dict[int, float] = _Latest(REQUEST_RECORDS)
        self.cached_prompt_tokens: dict[int, int] = _Latest(REQUEST_RECORDS)
        self.finish_reasons: dict[int, str] = _Latest(REQUEST_RECORDS)
        self.step_logprobs: dict[int, TokenLogprobs] = {}  # the last step's tokens, for requests asking logprobs
        self.failed: dict[int, str] = {}  # requests that failed in the last step (aborted): index -> why
        self.history: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)

    def _record(self, batch, decode_len: int, chunk_len: int, produced: int) -> None:
        stats = self.cache.stats()
        self._steps += 1
        self._attention_calls += (decode_len > 0) + (chunk_len > 0)
        compiled = (("decode", 0 if decode_len == 1 and self._sdpa else decode_len), ("chunk", 0 if self._sdpa else chunk_len))
        self._shapes.update(shape for shape in compiled if shape[1])
        self._peak_pages = max(self._peak_pages, stats.pages_used)
        self._utilisation_sum += stats.utilisation
        self._prefill_tokens += sum(n for _, n in batch.chunks)
        self._generated += produced
        self.history.append(StepRecord(time.perf_counter(), len(batch.decode), sum(n for _, n in batch.chunks),
                                       stats.pages_used, stats.utilisation))


class _Latest(OrderedDict):
    """A dict of the ``limit`` entries set last (the oldest leave first)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)


def _bucket(n: int, smallest: int) -> int:
    """Region sizes are powers of two (at least ``smallest``) so step shapes repeat."""
    return max(smallest, 1 << (n - 1).bit_length())
