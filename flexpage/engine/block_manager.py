"""The scheduler's one door to pages: rows, growth budgets, prefix caching, forks and rollback.

The ``BlockManager`` names sequences' pages by content (a key per full page, chained over every
token before it), finds a new request's longest cached prefix, attaches it, registers pages as
they fill, forks samples copy-on-write and gives pages back. It keeps its bookkeeping on each
``Sequence`` (``row``, ``num_computed``, ``block_keys``, ``num_registered``), so the scheduler
decides *which* sequences run and *how many* tokens, and never touches a page or a count.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable

from ..core.cache import PagedKVCache
from ..core.host import cdiv
from .sequence import Batch, Sequence


def page_key(previous: bytes, tokens: list[int]) -> bytes:
    """Content key of a full page: a hash of the previous page's key and the page's tokens, so
    equal keys mean equal prefixes."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockManager:
    """Pages of a ``PagedKVCache`` for the scheduler's sequences; with ``prefix_caching`` full
    pages are registered under their content keys and new sequences start from the longest
    registered prefix."""

    def __init__(self, cache: PagedKVCache, prefix_caching: bool = True) -> None:
        self.cache = cache
        self._pages = cache.page_table
        self.page_size = self._pages.page_size
        self.max_rows = self._pages.max_batch_size
        self.prefix_caching = prefix_caching
        self.hit_tokens = 0  # prompt tokens taken from the prefix cache so far

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take (free ones and cached ones nobody holds)."""
        return self._pages.num_free_pages

    @property
    def num_unused_pages(self) -> int:
        """Pages neither held nor cached (warm-up takes only these, so the prefix cache stays)."""
        return len(self._pages.free_pages)

    @property
    def max_seq_len(self) -> int:
        """The most tokens one sequence may hold (alone in the pool, beside its window row's pages)."""
        pages = self._pages.num_pages - self._pages.window_pages(self._pages.num_pages * self.page_size)
        return min(pages, self._pages.max_pages_per_seq) * self.page_size

    # ------------------------------------------------------------------ budgets
    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Pages (fresh and copy-on-write) that ``num_tokens`` more tokens of a running sequence take."""
        return self._pages.pages_needed(seq.row, num_tokens)

    def tokens_fitting(self, seq: Sequence, num_tokens: int, free_pages: int) -> int:
        """The most of ``num_tokens`` more tokens a running sequence can take within ``free_pages``."""
        if self.pages_needed(seq, num_tokens) <= free_pages:
            return num_tokens
        for pages in (free_pages, free_pages - 1):  # a shared partial last page takes one for its copy
            n = min(num_tokens, self._pages.room(seq.row, pages))
            if n > 0 and self.pages_needed(seq, n) <= free_pages:
                return n
        return 0

    def admission_pages(self, seq: Sequence, hit: list[int]) -> int:
        """Pages admitting a waiting sequence takes from the free pool, all its tokens counted,
        given its cached prefix ``hit`` (cached pages nobody holds count too) and its window row's pages
        (``PageTable.window_pages``)."""
        tokens = len(seq.tokens)
        return cdiv(tokens, self.page_size) - len(hit) + self._pages.unowned(hit) + self._pages.window_pages(tokens)

    # ------------------------------------------------------------------ prefix cache
    def keys(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Content keys of the full pages among the sequence's first ``num_tokens`` tokens
        (computed once per page and kept on the sequence)."""
        keys, page = seq.block_keys, self.page_size
        while (len(keys) + 1) * page <= num_tokens:
            i = len(keys)
            keys.append(page_key(keys[-1] if keys else b"", seq.tokens[i * page : (i + 1) * page]))
        return keys[: num_tokens // page]

    def prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the pages a sequence's prefill may share: all but its last token (whose logits
        pick the next token) are candidates. Empty without prefix caching."""
        return self.keys(seq, len(seq.tokens) - 1) if self.prefix_caching else []

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered pages holding the sequence's longest cached prefix."""
        return self._pages.lookup(self.prompt_keys(seq))

    def keys_being_computed(self, running: Iterable[Sequence]) -> set[bytes]:
        """Keys of prompt pages that running sequences will register once computed."""
        return {key for s in running if s.num_pending > 1 for key in self.prompt_keys(s)[s.num_registered :]}

    def register(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed pages to the prefix cache."""
        full = seq.num_computed // self.page_size
        if not self.prefix_caching or full <= seq.num_registered:
            return
        keys = self.keys(seq, full * self.page_size)
        for i in range(seq.num_registered, full):
            self._pages.register(seq.row, i, keys[i])
        seq.num_registered = full

    # ------------------------------------------------------------------ rows
    def allocate(self, seq: Sequence, hit: list[int]) -> int:
        """Give a waiting sequence a row starting from its cached prefix ``hit`` (``cached_prefix``);
        returns the cached pages this took off the free pool (nobody held them)."""
        revived = self._pages.unowned(hit)
        seq.row = self.cache.add_sequence()
        if hit:
            self._pages.attach(seq.row, hit)
        seq.num_registered, seq.num_computed = len(hit), len(hit) * self.page_size
        self.hit_tokens += seq.num_computed
        return revived

    def reserve(self, batch: Batch) -> None:
        """Reserve the slots of a scheduled step's new tokens (``Scheduler.rollback`` gives them back
        through ``truncate`` if its forward fails)."""
        work = batch.new_tokens()
        self.cache.reserve([seq.row for seq, _ in work], [n for _, n in work])

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """Give ``child`` a new row sharing all of the sequence's pages (copy-on-write when either
        writes) and its computed tokens' bookkeeping."""
        child.row = self.cache.fork(seq.row)
        child.num_computed, child.num_registered = seq.num_computed, seq.num_registered
        child.block_keys = list(seq.block_keys)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a running sequence back to its first ``num_tokens`` computed tokens (a failed step's
        or rejected drafts' slots given back); registered pages before them stay registered."""
        self._pages.truncate(seq.row, num_tokens)
        seq.num_computed = num_tokens
        seq.num_registered = min(seq.num_registered, num_tokens // self.page_size)

    def free(self, seq: Sequence, recompute: bool = False) -> None:
        """Give back a sequence's row and pages; with ``recompute`` (preemption) it will be
        computed again from its tokens."""
        self.cache.free_sequence(seq.row)
        seq.row = None
        if recompute:
            seq.num_computed = seq.num_registered = 0
