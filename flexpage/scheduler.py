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

import hashlib
from array import array
from collections import deque
from dataclasses import dataclass, field

from .cache import PagedKVCache
from .host import cdiv


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
    forks: int = 0  # sibling samples still to split off once the prompt is done (num_return_sequences - 1)
    block_keys: list[bytes] = field(default_factory=list)  # content keys of the first full pages
    num_registered: int = 0  # leading pages registered in the prefix cache
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache when first admitted

    def keys_upto(self, num_tokens: int, page_size: int) -> list[bytes]:
        """Content keys of the full pages among the first ``num_tokens`` tokens: a hash chained
        over every token up to each page's end, so equal keys mean equal prefixes."""
        keys = self.block_keys
        while (len(keys) + 1) * page_size <= num_tokens:
            i = len(keys)
            digest = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
            digest.update(array("q", self.tokens[i * page_size : (i + 1) * page_size]).tobytes())
            keys.append(digest.digest())
        return keys[: num_tokens // page_size]

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still need computing (1 for a sequence in decode)."""
        return len(self.tokens) - self.num_computed

    def append(self, token: int) -> None:
        self.tokens.append(token)
        if token in self.stop_token_ids or len(self.tokens) - self.prompt_len >= self.max_new_tokens:
            self.finished = True


@dataclass
class Batch:
    """One step's work: decode sequences (one token each) and prefill chunks ``(sequence, tokens)``."""

    decode: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)


class Scheduler:
    """FIFO admission, chunked prefill under a token budget, youngest-first preemption.

    With ``prefix_caching`` a request starts from the cached pages of its longest known
    prefix (their prefill is skipped), and the full pages it computes are registered for
    later requests.
    """

    def __init__(self, cache: PagedKVCache, max_batch_size: int, max_tokens_per_step: int, chunk_block: int = 16,
                 prefix_caching: bool = True):
        self.cache = cache
        self.prefix_caching = prefix_caching
        self.prefix_hit_tokens = 0
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
        needed = {s.index: pt.pages_needed(s.row, 1) for s in decode}
        while sum(needed.values()) > pt.num_free_pages and len(self.running) > 1:
            victim = self.running[-1]
            self.preempt(victim)
            decode = [s for s in decode if s is not victim]
            needed.pop(victim.index, None)
        free = pt.num_free_pages - sum(needed.values())
        budget = (self.max_tokens_per_step - len(decode)) // self.chunk_block * self.chunk_block
        batch = Batch(decode=decode)

        def take(seq: Sequence) -> None:
            nonlocal free, budget
            n = min(seq.num_pending, budget)
            if pt.pages_needed(seq.row, n) > free:  # as many tokens as the free pages and the last page's tail hold
                n = min(n, pt.room(seq.row, free))
                n = n if n > 0 and pt.pages_needed(seq.row, n) <= free else 0
            if n > 0:
                batch.chunks.append((seq, n))
                free -= pt.pages_needed(seq.row, n)
                budget -= cdiv(n, self.chunk_block) * self.chunk_block

        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                take(seq)
        computing = self._keys_being_computed() if self.waiting else set()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            rows = len(self.running) + sum(s.forks for s in self.running)  # samples still to fork need rows too
            if rows + 1 + seq.forks > self.max_batch_size:
                break
            hit = self.cached_prefix(seq)
            keys = seq.keys_upto(len(seq.tokens) - 1, page) if self.prefix_caching else []
            if len(hit) < len(keys) and keys[len(hit)] in computing:
                break  # a running request is computing its next page: wait a step and share it
            revived = pt.unowned(hit)  # cached pages it takes out of the free pool
            if cdiv(len(seq.tokens), page) - len(hit) + revived > free:  # admit only what the pool holds whole
                break
            self.waiting.popleft()
            seq.row = self.cache.add_sequence()
            if hit:
                pt.attach(seq.row, hit)
                seq.num_registered, seq.num_computed = len(hit), len(hit) * page
                self.prefix_hit_tokens += seq.num_computed
                if not seq.output:
                    seq.cached_tokens = max(seq.cached_tokens, seq.num_computed)
                free -= revived
            self.running.append(seq)
            take(seq)
            computing.update(keys[len(hit) :])
        return batch

    def _keys_being_computed(self) -> set[bytes]:
        """Content keys of prompt pages that running requests have yet to register."""
        if not self.prefix_caching:
            return set()
        page = self.page_table.page_size
        return {key for s in self.running if s.num_pending > 1
                for key in s.keys_upto(len(s.tokens) - 1, page)[s.num_registered :]}

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered pages holding the sequence's longest cached prefix; the last token is
        always left to compute (its logits pick the next token)."""
        if not self.prefix_caching:
            return []
        return self.page_table.lookup(seq.keys_upto(len(seq.tokens) - 1, self.page_table.page_size))

    def register_pages(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed pages to the prefix cache."""
        full = seq.num_computed // self.page_table.page_size
        if not self.prefix_caching or full <= seq.num_registered:
            return
        keys = seq.keys_upto(full * self.page_table.page_size, self.page_table.page_size)
        for i in range(seq.num_registered, full):
            self.page_table.register(seq.row, i, keys[i])
        seq.num_registered = full

    def computed(self, batch: Batch, sampled: list[Sequence]) -> list[tuple[Sequence, int]]:
        """After a step's forward: its tokens' K/V are in the cache (full pages offered to the
        prefix cache). Returns each sequence that picks a token now with its row of the step's
        logits (``sampled``'s order); a prompt just finished with ``n`` samples asked for splits
        into its ``n - 1`` siblings here (``forks``), each picking from the same row."""
        for seq in batch.decode:
            seq.num_computed += 1
        for seq, n in batch.chunks:
            seq.num_computed += n
        for seq in batch.decode + [seq for seq, _ in batch.chunks]:
            self.register_pages(seq)
        picks = []
        for row, seq in enumerate(sampled):
            if seq.forks and not seq.output:
                picks += [(self.fork(seq, seq.index + j), row) for j in range(1, seq.forks + 1)]
                seq.forks = 0
            picks.append((seq, row))
        return picks

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """A sibling sample of a running sequence sharing all of its pages (copy-on-write)."""
        child = Sequence(index, list(seq.tokens), seq.prompt_len, seq.max_new_tokens, seq.stop_token_ids,
                         row=self.cache.fork(seq.row), num_computed=seq.num_computed, arrival=seq.arrival,
                         block_keys=list(seq.block_keys), num_registered=seq.num_registered,
                         cached_tokens=seq.cached_tokens)
        self.running.append(child)
        return child

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it waits first in line and is recomputed later."""
        self.cache.free_sequence(seq.row)
        self.running.remove(seq)
        seq.row, seq.num_computed, seq.num_registered = None, 0, 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def abort(self, doomed) -> list[int]:
        """Drop every waiting or running sequence for which ``doomed(seq)``; returns their indices."""
        dropped = [s for s in self.waiting if doomed(s)] + [s for s in self.running if doomed(s)]
        self.waiting = deque(s for s in self.waiting if not doomed(s))
        for seq in [s for s in self.running if doomed(s)]:
            self.finish(seq)
        return [s.index for s in dropped]

    def finish(self, seq: Sequence) -> None:
        self.cache.free_sequence(seq.row)
        self.running.remove(seq)
        seq.row = None
