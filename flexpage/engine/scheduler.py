"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler owns the request queue; rows and pages it asks of the ``BlockManager``, and it
never touches models, pages or K/V bytes. Every step it (1) gives each running sequence that has finished its
prompt one decode token, preempting the youngest running sequences when the pool cannot
hold those tokens, (2) continues unfinished prompts in chunks, and (3) admits waiting
requests while rows, pages and the step's token budget allow. Preempted sequences lose
their pages and are recomputed from their tokens later (prompt and output so far), so
preemption never changes a token.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ..core.host import cdiv
from .block_manager import BlockManager
from .requests import StepOutput
from .sequence import Batch, Pick, Sequence
from .speculative import BatchProposer

MAX_DRAFT_PAUSE = 16  # the most steps a sequence whose drafts keep failing decodes before drafting again


class Scheduler:
    """FIFO admission, chunked prefill under a token budget, youngest-first preemption; pages
    only through the ``BlockManager``.

    With prefix caching a request starts from the cached pages of its longest known prefix
    (their prefill is skipped), and the full pages it computes are registered for later requests.
    """

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_step: int, chunk_block: int = 16,
                 propose: BatchProposer | None = None, num_speculative_tokens: int = 0, adaptive: bool = True):
        self.blocks = blocks
        self.propose, self.num_speculative_tokens, self.adaptive = propose, num_speculative_tokens, adaptive
        self.max_batch_size = min(max_batch_size, blocks.max_rows)
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
        """Choose the next step's work and reserve its rows and slots (the forward only writes them)."""
        blocks = self.blocks
        decode = [s for s in self.running if s.num_pending == 1]
        needed = {s.index: blocks.pages_needed(s, 1) for s in decode}
        while sum(needed.values()) > blocks.num_free_pages and len(self.running) > 1:
            victim = self.running[-1]
            self.preempt(victim)
            decode = [s for s in decode if s is not victim]
            needed.pop(victim.index, None)
        free = blocks.num_free_pages - sum(needed.values())
        batch = Batch(decode=decode)
        spare = self.max_tokens_per_step - len(decode)
        if self.propose is not None:
            free, spare = self._speculate(batch, needed, free, spare)
        budget = spare // self.chunk_block * self.chunk_block

        def take(seq: Sequence) -> None:
            nonlocal free, budget
            n = blocks.tokens_fitting(seq, min(seq.num_pending, budget), free)
            if n > 0:
                batch.chunks.append((seq, n))
                free -= blocks.pages_needed(seq, n)
                budget -= cdiv(n, self.chunk_block) * self.chunk_block

        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                take(seq)
        computing = blocks.keys_being_computed(self.running) if self.waiting else set()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            rows = len(self.running) + sum(len(s.siblings) for s in self.running)  # samples to fork need rows too
            if rows + 1 + len(seq.siblings) > self.max_batch_size:
                break
            hit, keys = blocks.cached_prefix(seq), blocks.prompt_keys(seq)
            if len(hit) < len(keys) and keys[len(hit)] in computing:
                break  # a running request is computing its next page: wait a step and share it
            if blocks.admission_pages(seq, hit) > free:  # admit only what the pool holds whole
                break
            self.waiting.popleft()
            free -= blocks.allocate(seq, hit)
            if hit and not seq.output:
                seq.cached_tokens = max(seq.cached_tokens, seq.num_computed)
            self.running.append(seq)
            take(seq)
            computing.update(keys[len(hit) :])
        blocks.reserve(batch)
        return batch

    def _speculate(self, batch: Batch, needed: dict[int, int], free: int, spare: int) -> tuple[int, int]:
        """Move decode sequences with drafts (``propose``) into ``batch.verify`` where their pages and
        the step's tokens allow, oldest first; drafts never preempt or delay a prompt already
        running. Returns the free pages and tokens left."""
        asks = []
        for seq in batch.decode:
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            limit = min(seq.draft_len or self.num_speculative_tokens, seq.max_new_tokens - len(seq.output) - 1, spare)
            if limit > 0:
                asks.append((seq, limit))
        proposals = self.propose([(seq.tokens, limit) for seq, limit in asks]) if asks else []
        for (seq, _), drafts in zip(asks, proposals):
            drafts = drafts[:spare]
            if seq.constraint is not None and drafts:  # drafts its grammar refuses would be rejected anyway
                drafts = drafts[: seq.constraint.valid_prefix(drafts)]
            n = self.blocks.tokens_fitting(seq, 1 + len(drafts), free + needed[seq.index])
            cost = cdiv(n, self.chunk_block) * self.chunk_block  # a row of the chunk region, for its decode token
            if n > 1 and cost - 1 <= spare:
                seq.drafts = drafts[: n - 1]
                batch.decode.remove(seq)
                batch.verify.append(seq)
                free -= self.blocks.pages_needed(seq, n) - needed[seq.index]
                spare -= cost - 1
        return free, spare

    def postprocess(self, batch: Batch, picks: list[Pick]) -> list[StepOutput]:
        """After a step's forward: its tokens' K/V are in the cache (full pages offered to the prefix
        cache), a prompt just computed splits off its sibling samples (rows sharing its pages), and
        each pick's tokens are appended: a sequence they end, or whose pick failed, gives its pages
        back, and a speculating one's rejected drafts are dropped (``settle``). Returns a record
        per token and per failure."""
        for seq, n in batch.new_tokens():
            seq.num_computed += n
        for seq in batch.decode + [seq for seq, _ in batch.chunks]:
            self.blocks.register(seq)
        for pick in picks:
            if pick.parent is not None:  # a sibling sample: it picked from its parent's row
                self.fork(pick.seq, pick.parent)
                pick.parent.siblings = []
        records = []
        for pick in picks:
            seq = pick.seq
            for token, logprobs in zip(pick.tokens, pick.logprobs):
                first = len(seq.tokens) == seq.prompt_len
                seq.append(token)
                records.append(StepOutput(seq.index, token, seq.finish_reason, logprobs,
                                          seq.cached_tokens if first else None,
                                          time.perf_counter() - seq.arrival if first else None))
            if seq.drafts:
                self.settle(seq, pick.accepted)
            if pick.error is not None:
                records.append(StepOutput(seq.index, None, "error", error=pick.error))
            if seq.finished or pick.error is not None:
                self.finish(seq)
        return records

    def settle(self, seq: Sequence, accepted: int) -> None:
        """A speculating sequence has appended the tokens it accepted: the K/V of its rejected
        drafts are dropped (their slots given back) and its full pages registered. With
        ``adaptive`` speculation its next draft is two longer after a whole draft was accepted,
        one shorter otherwise, and once ``n >= 2`` verifications in a row accepted nothing it decodes
        ``2 ** (n - 1)`` steps (at most ``MAX_DRAFT_PAUSE``) without drafts: wrong drafts cost little."""
        if self.adaptive:
            whole = accepted == len(seq.drafts)
            seq.draft_len = max(1, min(self.num_speculative_tokens, len(seq.drafts) + (2 if whole else -1)))
            seq.draft_misses = 0 if accepted else seq.draft_misses + 1
            seq.draft_pause = min(2 ** (seq.draft_misses - 1), MAX_DRAFT_PAUSE) if seq.draft_misses > 1 else 0
        seq.drafts = []
        if seq.row is not None:  # still running
            self.blocks.truncate(seq, len(seq.tokens) - 1)
            self.blocks.register(seq)

    def rollback(self, batch: Batch) -> None:
        """A step's forward failed: its tokens were never computed, their slots go back."""
        for seq in batch.stepped:
            seq.drafts = []
            self.blocks.truncate(seq, seq.num_computed)

    def fork(self, child: Sequence, seq: Sequence) -> None:
        """Start a sibling sample of a running sequence on a row sharing all of its pages (copy-on-write)."""
        self.blocks.fork(seq, child)
        child.cached_tokens = seq.cached_tokens
        self.running.append(child)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it waits first in line and is recomputed later."""
        self.blocks.free(seq, recompute=True)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def abort(self, doomed: Callable[[Sequence], bool]) -> list[int]:
        """Drop every waiting or running sequence, and every sibling sample not yet split off, for
        which ``doomed(seq)``; returns their indices. The sibling samples of a dropped sequence not yet
        split off go on without it: the first takes its place in the queue (first in line, to be computed
        again, if it was running) with the others as its siblings."""
        dropped, heirs = [], {}
        for seq in [*self.waiting, *self.running]:
            dropped += [s for s in seq.siblings if doomed(s)]
            seq.siblings = [s for s in seq.siblings if not doomed(s)]
            if doomed(seq) and seq.siblings:
                heir = heirs[seq] = seq.siblings[0]
                heir.siblings, seq.siblings = seq.siblings[1:], []
        stopped = [s for s in self.running if doomed(s)]
        dropped += [s for s in self.waiting if doomed(s)] + stopped
        self.waiting = deque(heirs.get(s, s) for s in self.waiting if not doomed(s) or s in heirs)
        for seq in stopped:
            self.finish(seq)
        self.waiting.extendleft(reversed([heirs[s] for s in stopped if s in heirs]))  # first in line, as if preempted
        return [s.index for s in dropped]

    def finish(self, seq: Sequence) -> None:
        """A running sequence ended (or failed): its row and pages go back."""
        self.blocks.free(seq)
        self.running.remove(seq)
