"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler owns the request queue and the rows of a ``PagedKVCache``; it never touches
models or K/V bytes. Every step it (1) gives each running sequence that has finished its
prompt one decode token, preempting the youngest running sequences when the pool cannot
hold those tokens, (2) continues unfinished prompts in chunks, and (3) admits waiting
requests while rows, pages and the step's token budget allow. Preempted sequences lose
their pages and are recomputed from their tokens later (prompt and output so far), so
preemption never changes a token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache import PagedKVCache
from .pages import cdiv


@dataclass
class Sequence:
    """One request's tokens and progress; ``tokens`` is the prompt followed by the output."""

    index: int  # the request's position in the caller's input
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    row: int | None = None  # page-table row while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    finished: bool = False
    arrival: float = 0.0  # perf_counter() when the request was queued

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still need computing (1 for a sequence in decode)."""
        return len(self.tokens) - self.num_computed

    def append(self, token: int) -> None:
        self.tokens.append(token)
        if token in self.stop_token_ids or len(self.output) >= self.max_new_tokens:
            self.finished = True


@dataclass
class Batch:
    """One step's work: decode sequences (one token each) and prefill chunks ``(sequence, tokens)``."""

    decode: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)


class Scheduler:
    """FIFO admission, chunked prefill under a token budget, youngest-first preemption."""

    def __init__(self, cache: PagedKVCache, max_batch_size: int, max_tokens_per_step: int, chunk_block: int = 16):
        self.cache = cache
        self.page_table = cache.page_table
        self.max_batch_size = min(max_batch_size, self.page_table.max_batch_size)
        self.max_tokens_per_step = max_tokens_per_step
        self.chunk_block = chunk_block
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Choose the next step's work; rows are claimed here, pages in ``cache.begin_packed_step``."""
        pt, page = self.page_table, self.page_table.page_size
        decode = [s for s in self.running if s.num_pending == 1]
        while sum(pt.pages_needed(s.row, 1) for s in decode) > pt.num_free_pages and len(self.running) > 1:
            victim = self.running[-1]
            self.preempt(victim)
            decode = [s for s in decode if s is not victim]
        free = pt.num_free_pages - sum(pt.pages_needed(s.row, 1) for s in decode)
        budget = (self.max_tokens_per_step - len(decode)) // self.chunk_block * self.chunk_block
        batch = Batch(decode=decode)

        def take(seq: Sequence) -> None:
            nonlocal free, budget
            n = min(seq.num_pending, budget)
            if pt.pages_needed(seq.row, n) > free:  # as many tokens as the free pages and the last page's tail hold
                n = min(n, free * page + (-pt.seq_lens[seq.row]) % page)
                n = n if n > 0 and pt.pages_needed(seq.row, n) <= free else 0
            if n > 0:
                batch.chunks.append((seq, n))
                free -= pt.pages_needed(seq.row, n)
                budget -= cdiv(n, self.chunk_block) * self.chunk_block

        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                take(seq)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if cdiv(seq.num_pending, page) > free:  # admit only what the pool can hold whole
                break
            self.waiting.popleft()
            seq.row = self.cache.add_sequence()
            self.running.append(seq)
            take(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it waits first in line and is recomputed later."""
        self.cache.free_sequence(seq.row)
        self.running.remove(seq)
        seq.row, seq.num_computed = None, 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        self.cache.free_sequence(seq.row)
        self.running.remove(seq)
        seq.row = None
