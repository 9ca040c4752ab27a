"""Page allocator and page table: which physical pages hold which sequence's tokens.

Knows nothing about K/V tensors. Host-side bookkeeping (free list, reference counts,
per-sequence page lists and lengths) is plain Python so it never syncs with the device;
the page table, the per-page logical block index and the lengths are mirrored in device
tensors that are updated in place, so compiled code that reads them never changes shape.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ..errors import OutOfPagesError
from .host import cdiv, host_tensor
from .policy import device_policy

RELEASED = -1  # a row's entry for a page it gave back: wholly before every query's window (``PageTable.window``)
WINDOW_KEY = b"w"  # appended to a page's content key for the same tokens' page of a window row (prefix caching)


@dataclass(frozen=True)
class StepPlan:
    """Where one forward step's query tokens live, for a batch of page-table rows.

    Query tokens are left-padded to a common length ``q_len``: row ``b``'s real tokens are
    the last ``new_tokens[b]`` of its ``q_len`` positions. Padding is never stored in pages:
    its slots point at the cache's sink page.
    """

    rows: torch.Tensor  # [B] int64, page-table rows of the batch, in batch order
    row_ids: tuple[int, ...]  # the same rows, on the host
    row_lens: tuple[int, ...]  # kv_lens, on the host
    q_start: torch.Tensor  # [B] int32, logical position of query index 0 (negative if padded)
    kv_lens: torch.Tensor  # [B] int32, tokens in the cache once this step is written
    slots: torch.Tensor  # [B, q_len] int64, pool slot of each query token
    q_len: int
    max_new: int  # the longest row's new tokens: only the last ``max_new`` columns are ever real
    fresh: bool  # no row held tokens before this step (a prefill from scratch)


@dataclass(frozen=True)
class PackedPlan:
    """One ragged step: many rows' new tokens packed into a single query row, no batch padding.

    The leading positions hold the decode tokens, one per row of ``decode_rows`` (attended as a
    batch of ``decode_len`` one-token rows: the bucket a compiled call is shaped for, its rows past
    the real ones empty); after them come prefill chunks, each starting at a multiple of
    ``chunk_block`` so that a query block never spans two sequences. Positions left over (chunk
    alignment, the chunk region's bucket tail) are padding: row 0, position -1, slot in the sink
    page. An eager forward computes each decode token once (``decode_tokens`` = the real ones); a
    compiled step feeds all ``decode_len`` positions (``pad_decode``: the rows past the real ones
    write to the sink page and see nothing), so its shapes repeat.
    """

    slots: torch.Tensor  # [1, q_len] int64, pool slot of each packed token
    tok_rows: torch.Tensor  # [q_len] int64, page-table row of each token
    tok_pos: torch.Tensor  # [q_len] int64, logical position of each token (-1: padding)
    position_ids: torch.Tensor  # [1, q_len] int64, the model's position ids (padding at 0)
    decode_rows: tuple[int, ...]  # the rows of the leading decode tokens, on the host
    chunks: tuple[tuple[int, int], ...]  # ``(row, num_tokens)`` of each prefill chunk, on the host
    decode_len: int
    chunk_block: int
    q_len: int
    decode_tokens: int  # positions of the decode region in the packed row: the real tokens, or decode_len
    window_plan: PackedPlan | None = None  # the same step over the rows' window rows (``PageTable.sliding_window``)

    @property
    def max_new(self) -> int:
        return self.q_len  # every forward of a packed step feeds all of its positions

    @property
    def num_decode(self) -> int:
        """Decode tokens: the step's first positions (``decode_len`` rows in attention)."""
        return len(self.decode_rows)

    fresh = False  # a packed step always reads pages, never only its own new K/V


def check_packed_layout(
    num_decode: int, chunk_tokens: Sequence[int], decode_len: int, chunk_len: int, chunk_block: int
) -> None:
    """Raise ValueError unless the decode tokens and block-aligned chunks fit their regions."""
    if num_decode > decode_len:
        raise ValueError(f"{num_decode} decode tokens do not fit a decode region of {decode_len}")
    if chunk_block < 1 or chunk_len % chunk_block:
        raise ValueError(f"chunk region ({chunk_len}) must be a multiple of chunk_block ({chunk_block})")
    if any(n < 1 for n in chunk_tokens):
        raise ValueError(f"prefill chunks must hold at least one token, got {list(chunk_tokens)}")
    needed = sum(cdiv(n, chunk_block) * chunk_block for n in chunk_tokens)
    if needed > chunk_len:
        raise ValueError(f"prefill chunks need {needed} block-aligned positions, the chunk region has {chunk_len}")


def _decode_positions(decode_rows: Sequence[int], lens: Sequence[int]) -> list[int]:
    """The logical position each decode row feeds: its row's last token, or, for a row listed ``m``
    times, its last ``m`` tokens in order."""
    if len(set(decode_rows)) == len(decode_rows):
        return [lens[row] - 1 for row in decode_rows]
    left = Counter(decode_rows)
    positions = []
    for row in decode_rows:
        positions.append(lens[row] - left[row])
        left[row] -= 1
    return positions


class PageTable:
    """Fixed pool of ``num_pages`` pages of ``page_size`` token slots, shared by up to
    ``max_batch_size`` sequences (rows) of at most ``max_pages_per_seq`` pages each.

    Pages are reference counted so rows can share them (forks, prefixes); a shared page
    that is only partly filled is copied before a row writes into it (copy-on-write).
    Every mutating method either completes or raises leaving all state unchanged.

    Prefix caching: a full page can be registered under a key naming its content (a hash
    chained over every token up to its end). Registered pages are never written in place;
    when nobody references one it stays *cached* (its K/V intact, findable by ``lookup``)
    until an allocation needs it, least recently released first.

    Sliding windows: once ``window`` is set (every layer attends at most that many positions
    back), a row growing past it gives back the pages wholly before its earliest query's window;
    its page list keeps ``RELEASED`` in their place, so logical page indices never move.

    Layer groups: where some layers attend a ``sliding_window`` and the others every position
    (Gemma 2), each row has a *window row* (``window_row``) holding the pages of the windowed
    layers, which keeps only the pages of its last ``sliding_window`` positions and gives the rest
    back. Both rows draw on the one pool (the cache lays a windowed layer's K/V in the same pool
    tensors as a global layer's: a page belongs to one row at a time), grow, fork, truncate and free
    together, and every method taking a row acts on both.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_batch_size: int,
        max_pages_per_seq: int | None = None,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
        if not 1 <= max_pages_per_seq <= num_pages:
            raise ValueError(f"max_pages_per_seq must be in [1, num_pages={num_pages}], got {max_pages_per_seq}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_pages_per_seq = max_pages_per_seq
        self.device = torch.device(device)
        self.sliding_window = sliding_window  # the window rows' window (None: no window rows)
        total_rows = max_batch_size * (1 if sliding_window is None else 2)  # window rows after the rows
        # Host-side truth.
        self.free_pages: deque[int] = deque(range(num_pages))
        self.ref_counts = [0] * num_pages
        self.cached_pages: OrderedDict[int, None] = OrderedDict()  # unreferenced registered pages, LRU first
        self.page_keys: dict[int, bytes] = {}  # registered page -> content key
        self.key_pages: dict[bytes, int] = {}  # content key -> registered page
        self.seq_pages: list[list[int] | None] = [None] * total_rows  # None: row unused
        self.seq_lens = [0] * total_rows
        self.window: int | None = None  # positions back any query attends, where every layer has a window
        self.first_held = [0] * total_rows  # each row's first page it still holds (pages before: released)
        # Live-token accounting, kept as pages change (no walk over the rows per step): a page's
        # fill is how many of its slots hold tokens of its owners (the most any owner holds: owners
        # of a shared page agree unless one was truncated, since nobody writes into a shared page);
        # live_tokens sums the fill of pages somebody holds.
        self.page_fill = [0] * num_pages
        self.live_tokens = 0
        self._uneven: set[int] = set()  # shared pages truncated by one owner: owners' fills differ
        # Device mirrors read by masks and slot computation.
        self.table = torch.full((total_rows, max_pages_per_seq), -1, dtype=torch.int32, device=self.device)
        # Logical block index of each physical page (-1: free, and for the sink page at the
        # end). A page sits at the same logical index in every row that shares it.
        self.page_logical = torch.full((num_pages + 1,), -1, dtype=torch.int32, device=self.device)
        self.lens = torch.zeros(total_rows, dtype=torch.int32, device=self.device)
        # On CPU the mirrors are written through NumPy views of the same memory: a step's few
        # updates then cost no tensor op each (tens of microseconds a step at batch 32).
        self._host = ({name: getattr(self, name).numpy() for name in ("table", "page_logical", "lens")}
                      if device_policy(self.device).zero_copy_host_ints else {})

    def _set(self, mirror: str, index: Any, values: int | Sequence[int]) -> None:
        """``mirror[index] = values`` for host ints: through the NumPy view on CPU, else one copy."""
        host = self._host.get(mirror)
        if host is not None:
            host[index] = values
        else:
            getattr(self, mirror)[index] = torch.as_tensor(values, dtype=torch.int32).to(self.device)

    # ------------------------------------------------------------------ queries
    @property
    def sink_slot(self) -> int:
        """First slot of the sink page (one page past the pool) where padding is written."""
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody references."""
        return len(self.free_pages) + len(self.cached_pages)

    @property
    def active_rows(self) -> list[int]:
        return [r for r, pages in enumerate(self.seq_pages[: self.max_batch_size]) if pages is not None]

    def window_row(self, row: int) -> int:
        """The window row of ``row``: its windowed layers' pages (``sliding_window``)."""
        if self.sliding_window is None:
            raise ValueError("this page table keeps no window rows (sliding_window is None)")
        return row + self.max_batch_size

    def rows_of(self, row: int) -> list[int]:
        """``row`` and its window row, where it has one."""
        return [row] if self.sliding_window is None else [row, self.window_row(row)]

    def pages_of(self, row: int) -> list[int]:
        return list(self._pages(row))

    def slots_of(self, pages: Sequence[int]) -> torch.Tensor:
        """Every pool slot of ``pages``, page by page (int64, on the host)."""
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size + torch.arange(self.page_size)).view(-1)

    def pages_needed(self, row: int, num_tokens: int) -> int:
        """New pages (fresh + copy-on-write) that ``extend(row, num_tokens)`` would take (its window row's too)."""
        self._pages(row)
        return sum(self._pages_needed(r, num_tokens) for r in self.rows_of(row))

    def _pages_needed(self, row: int, num_tokens: int) -> int:
        pages, length = self.seq_pages[row], self.seq_lens[row]
        fresh = max(0, cdiv(length + num_tokens, self.page_size) - len(pages))
        return fresh + int(self._needs_copy(row, num_tokens))

    def room(self, row: int, free_pages: int) -> int:
        """Tokens ``row`` can take in the rest of its last page and ``free_pages`` more pages (a window
        row grows page for page with its row)."""
        return free_pages // len(self.rows_of(row)) * self.page_size + (-self.seq_lens[row]) % self.page_size

    def window_pages(self, num_tokens: int) -> int:
        """The most pages a window row holds for a sequence of ``num_tokens`` decoding (0 without
        window rows): the window's pages and the one being written."""
        if self.sliding_window is None:
            return 0
        return min(cdiv(num_tokens, self.page_size), cdiv(self.sliding_window, self.page_size) + 1)

    def unowned(self, pages: Sequence[int]) -> int:
        """How many of these cached pages (``lookup``'s; their window pages too) no sequence holds
        (attaching them takes them off the free list)."""
        return sum(1 for page in [*pages, *self._window_pages(pages)] if self.ref_counts[page] == 0)

    # ------------------------------------------------------------------ row lifecycle
    def add_sequence(self, row: int | None = None) -> int:
        """Claim an empty row (the lowest free one unless ``row`` is given) and return it."""
        if row is None:
            free = [r for r, pages in enumerate(self.seq_pages) if pages is None]
            if not free:
                raise OutOfPagesError(f"all {self.max_batch_size} sequence rows are in use")
            row = free[0]
        elif not 0 <= row < self.max_batch_size:
            raise ValueError(f"row must be in [0, {self.max_batch_size}), got {row}")
        elif self.seq_pages[row] is not None:
            raise ValueError(f"row {row} is already in use")
        for r in self.rows_of(row):
            self.seq_pages[r] = []
            self.seq_lens[r] = 0
            self.first_held[r] = 0
        return row

    def free_sequence(self, row: int) -> None:
        """Release a row and drop its references; pages nobody owns return to the free list
        (registered ones to the cache, the sequence's tail first so prefixes outlive it)."""
        self._pages(row)
        for r in self.rows_of(row):
            pages = self.seq_pages[r]
            self.seq_pages[r] = None  # references are dropped once the row no longer lists them
            self.seq_lens[r] = 0
            for page in reversed(pages[self.first_held[r] :]):
                self._unref(page)
            self._set("table", r, -1)
            self._set("lens", r, 0)
        if len(self.free_pages) == self.num_pages:  # an empty pool hands out pages in order again,
            self.free_pages = deque(range(self.num_pages))  # so a lone sequence's K/V stay contiguous

    def fork(self, src: int, dst: int | None = None) -> int:
        """New row sharing every page of ``src`` (each gains a reference)."""
        self._pages(src)
        dst = self.add_sequence(dst)
        for s, d in zip(self.rows_of(src), self.rows_of(dst)):
            pages = self.seq_pages[s]
            for page in pages[self.first_held[s] :]:
                self.ref_counts[page] += 1
            self.seq_pages[d] = list(pages)
            self.seq_lens[d] = self.seq_lens[s]
            self.first_held[d] = self.first_held[s]
            self.table[d] = self.table[s]
            self.lens[d] = self.seq_lens[s]
        return dst

    def permute(self, rows: Sequence[int], sources: Sequence[int]) -> None:
        """Make ``rows[i]`` hold what ``sources[i]`` held (beam reordering): page lists and
        reference counts move, K/V bytes do not. Sources must be among ``rows``."""
        if len(rows) != len(sources) or not set(sources) <= set(rows):
            raise ValueError(f"sources {list(sources)} must be taken from rows {list(rows)}")
        for row in rows:
            self._pages(row)
        self._permute(rows, sources)
        if self.sliding_window is not None:
            self._permute([self.window_row(r) for r in rows], [self.window_row(r) for r in sources])

    def _permute(self, rows: Sequence[int], sources: Sequence[int]) -> None:
        new_pages = [list(self.seq_pages[src]) for src in sources]
        new_lens = [self.seq_lens[src] for src in sources]
        new_first = [self.first_held[src] for src in sources]
        for pages, first in zip(new_pages, new_first):
            for page in pages[first:]:
                self.ref_counts[page] += 1
        old_pages = [self.seq_pages[row][self.first_held[row] :] for row in rows]
        for row, pages, length, first in zip(rows, new_pages, new_lens, new_first):
            self.seq_pages[row], self.seq_lens[row], self.first_held[row] = pages, length, first
            self._mirror(row)
        for pages in old_pages:  # once every row lists its new pages
            for page in pages:
                self._unref(page)

    def truncate(self, row: int, length: int) -> None:
        """Keep only the first ``length`` tokens of a row; pages past them lose a reference."""
        self._pages(row)
        if not 0 <= length <= self.seq_lens[row]:
            raise ValueError(f"cannot truncate row {row} of {self.seq_lens[row]} tokens to {length}")
        if any(self._window_start(r, length) < self.first_held[r] for r in self.rows_of(row)):
            raise ValueError(f"cannot truncate row {row} to {length} tokens: the pages its window would need "
                             f"were given back")
        for r in self.rows_of(row):
            self._truncate(r, length)

    def _truncate(self, row: int, length: int) -> None:
        pages = self.seq_pages[row]
        keep = cdiv(length, self.page_size)
        dropped = pages[keep:]
        del pages[keep:]
        self.seq_lens[row] = length
        for page in dropped:
            self._unref(page)
        held = keep > self.first_held[row]  # its last page is still its own (not given back)
        if held and self.ref_counts[pages[-1]] == 1:  # a private last page holds what is kept
            fill = length - (keep - 1) * self.page_size
            self.live_tokens += fill - self.page_fill[pages[-1]]
            self.page_fill[pages[-1]] = fill
        elif held:  # shared: the other owners may hold more of it
            self._refill(pages[-1])
            self._uneven.add(pages[-1])
        self._mirror(row)

    # ------------------------------------------------------------------ growth
    def extend(self, rows: Sequence[int], num_tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Grow each row by its number of tokens, all or nothing.

        Returns the copy-on-write page copies ``(src_page, dst_page)`` the cache must perform
        before writing: a row whose partly-filled last page is shared gets a private copy.
        Raises ``OutOfPagesError`` (nothing changed) when the pool or a row's page budget
        cannot hold the tokens.
        """
        if len(rows) != len(num_tokens):
            raise ValueError(f"rows ({len(rows)}) and num_tokens ({len(num_tokens)}) differ in length")
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct, got {list(rows)}")
        for row in rows:
            self._pages(row)  # ValueError for a row holding no sequence
        if self.sliding_window is not None:  # window rows grow with their rows
            rows, num_tokens = [*rows, *(self.window_row(r) for r in rows)], [*num_tokens, *num_tokens]
        page_size, needed, growth = self.page_size, 0, []
        for row, n in zip(rows, num_tokens):
            pages, length = self.seq_pages[row], self.seq_lens[row]
            if n < 0:
                raise ValueError(f"num_tokens must be >= 0, got {n} for row {row}")
            total_pages = cdiv(length + n, page_size)
            if total_pages > self.max_pages_per_seq:
                raise OutOfPagesError(
                    f"row {row} would need {total_pages} pages for {length + n} tokens; "
                    f"a sequence may hold at most {self.max_pages_per_seq} pages "
                    f"({self.max_pages_per_seq * page_size} tokens)"
                )
            needed += self._pages_needed(row, n)
            growth.append((row, n, pages, length, total_pages))
        if needed > self.num_free_pages:
            raise OutOfPagesError(
                f"need {needed} free pages for {sum(num_tokens)} new tokens, "
                f"only {self.num_free_pages} of {self.num_pages} are free"
            )
        copies = []
        for row, n, pages, length, total_pages in growth:
            copy = self._needs_copy(row, n)  # asked again: an earlier row's copy may have unshared the page
            if length % page_size and total_pages == len(pages) and not copy:
                self.page_fill[pages[-1]] += n  # the common decode step: the tokens fit the private last page
            else:
                if copy:
                    copies.append(self._copy_last_page(row))
                first_new = len(pages)
                for _ in range(total_pages - first_new):
                    pages.append(self._alloc())
                for i in range(length // page_size, total_pages if n else 0):  # private pages written into
                    self.page_fill[pages[i]] = min(page_size, length + n - i * page_size)
                if total_pages > first_new:
                    self._set("table", (row, slice(first_new, total_pages)), pages[first_new:])
                    self._set("page_logical", pages[first_new:], list(range(first_new, total_pages)))
            self.live_tokens += n
            self.seq_lens[row] = length + n
            self._release(row, self._window_start(row, length))  # the step's earliest query is at ``length``
        if rows:
            self._set("lens", list(rows), [self.seq_lens[r] for r in rows])
        return copies

    def plan(self, rows: Sequence[int], new_tokens: Sequence[int], q_len: int | None = None) -> StepPlan:
        """Describe a step whose ``new_tokens[b]`` tokens were just added by ``extend``."""
        q_len = max(new_tokens) if q_len is None else q_len
        if q_len < max(new_tokens, default=0):
            raise ValueError(f"q_len={q_len} is shorter than the longest row ({max(new_tokens)} tokens)")
        # Computed on the host from the page lists: one tensor per field, whatever the batch,
        # costs less per step than the equivalent chain of small device ops.
        lens = [self.seq_lens[r] for r in rows]
        slots = []
        for row, length, n in zip(rows, lens, new_tokens):
            pages, page = self.seq_pages[row], self.page_size
            slots += [self.sink_slot] * (q_len - n)
            slots += [pages[p // page] * page + p % page for p in range(length - n, length)]
        rows_t, kv_lens = self._tensor(list(rows)), self._tensor(lens, torch.int32)
        q_start = self._tensor([n - q_len for n in lens], torch.int32)
        slots = self._tensor(slots).view(len(lens), q_len)
        fresh = all(length == n for length, n in zip(lens, new_tokens))
        return StepPlan(rows=rows_t, row_ids=tuple(rows), row_lens=tuple(lens), q_start=q_start, kv_lens=kv_lens,
                        slots=slots, q_len=q_len, max_new=max(new_tokens, default=0), fresh=fresh)

    # ------------------------------------------------------------------ prefix cache
    def register(self, row: int, index: int, key: bytes) -> None:
        """Record that the row's full page ``index`` holds the content named ``key``.

        The first page registered under a key keeps it (a later duplicate stays private). A window
        row's page of the same tokens, while it holds it, is registered under ``key + WINDOW_KEY``.
        """
        self._pages(row)
        if (index + 1) * self.page_size > self.seq_lens[row]:
            raise ValueError(f"page {index} of row {row} is not full ({self.seq_lens[row]} tokens)")
        for r, name in zip(self.rows_of(row), (key, key + WINDOW_KEY)):
            page = self.seq_pages[r][index]
            if page != RELEASED and name not in self.key_pages and page not in self.page_keys:
                self.key_pages[name], self.page_keys[page] = page, name

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Registered pages of the longest prefix of ``keys`` (the chain stops at the first miss; with
        window rows, at the first page whose window page is not registered too)."""
        pages = []
        for key in keys:
            page = self.key_pages.get(key)
            if page is None or self.sliding_window is not None and key + WINDOW_KEY not in self.key_pages:
                break
            pages.append(page)
        return pages

    def _window_pages(self, pages: Sequence[int]) -> list[int]:
        """The window pages registered beside these registered pages (none without window rows)."""
        if self.sliding_window is None:
            return []
        return [self.key_pages[self.page_keys[page] + WINDOW_KEY] for page in pages]

    def attach(self, row: int, pages: Sequence[int]) -> None:
        """Give an empty row the registered ``pages`` (from ``lookup``) as its first tokens (its window
        row their window pages)."""
        if self._pages(row) or any(p not in self.page_keys for p in pages):
            raise ValueError(f"attach needs an empty row and registered pages, got row {row} and {list(pages)}")
        if len(pages) > self.max_pages_per_seq:
            raise OutOfPagesError(f"{len(pages)} pages exceed a sequence's {self.max_pages_per_seq}")
        window_pages = self._window_pages(pages)  # KeyError before anything changes if one is missing
        for r, held in zip(self.rows_of(row), (pages, window_pages)):
            self._attach(r, held)

    def _attach(self, row: int, pages: Sequence[int]) -> None:
        for page in pages:
            self.cached_pages.pop(page, None)
            held = self.page_fill[page] if self.ref_counts[page] else 0  # a registered page is full
            if held and held < self.page_size:  # its holder was truncated into it
                self._uneven.add(page)
            self.live_tokens += self.page_size - held
            self.page_fill[page] = self.page_size
            self.ref_counts[page] += 1
        self.seq_pages[row] = list(pages)
        self.seq_lens[row] = len(pages) * self.page_size
        self._mirror(row)

    def clear_prefix_cache(self) -> None:
        """Forget every registered page: cached ones become free, held ones stay with their rows."""
        for page in self.cached_pages:
            self.free_pages.append(page)
            self.page_logical[page] = -1
            self.page_fill[page] = 0
        self.cached_pages.clear()
        self.page_keys.clear()
        self.key_pages.clear()

    def static_plan(self, decode_len: int) -> PackedPlan:
        """The plan of a decode-only step of ``decode_len`` rows whose tensors are written in place
        by every such step (``plan_packed(..., into=)``): one per compiled bucket. Its rows live in
        its tensors only (``decode_rows`` is empty); all of them are fed, padding to the sink page."""
        def ints(value: int) -> torch.Tensor:
            return torch.full((decode_len,), value, dtype=torch.int64, device=self.device)

        def plan(window_plan: PackedPlan | None = None) -> PackedPlan:
            return PackedPlan(slots=ints(self.sink_slot).view(1, decode_len), tok_rows=ints(0), tok_pos=ints(-1),
                              position_ids=ints(0).view(1, decode_len), decode_rows=(), chunks=(),
                              decode_len=decode_len, chunk_block=1, q_len=decode_len, decode_tokens=decode_len,
                              window_plan=window_plan)

        return plan(None if self.sliding_window is None else plan())

    def plan_packed(self, decode_rows: Sequence[int], chunks: Sequence[tuple[int, int]], decode_len: int,
                    chunk_len: int, chunk_block: int, pad_decode: bool = False,
                    into: PackedPlan | None = None) -> PackedPlan:
        """Describe a ragged step whose tokens were just added by ``extend``, in a layout the caller
        checked with ``check_packed_layout`` before extending (``PagedKVCache.begin_packed_step``).

        ``decode_rows`` each feed their last token (a row listed ``m`` times feeds its last ``m``, in
        order: a speculating row's verified tokens as decode rows); ``chunks`` are ``(row,
        num_tokens)`` prefill chunks ending at the row's last token. The decode tokens are attended as ``decode_len``
        one-token rows, the chunk region is ``chunk_len`` positions (both bucketed by the caller,
        so compiled shapes repeat); with ``pad_decode`` the packed row holds all ``decode_len``
        decode positions, the padding ones written to the sink page. ``into``: a ``static_plan`` of
        ``decode_len`` for a padded decode-only step, whose tensors are rewritten and which is returned.
        With window rows the plan carries the same step over them (``window_plan``: their slots, and
        rows for their masks).
        """
        plan = self._plan_packed(decode_rows, chunks, decode_len, chunk_len, chunk_block, pad_decode, into)
        if self.sliding_window is None:
            return plan
        window = self._plan_packed([self.window_row(r) for r in decode_rows],
                                   [(self.window_row(r), n) for r, n in chunks], decode_len, chunk_len, chunk_block,
                                   pad_decode, None if into is None else into.window_plan)
        return plan if into is not None else replace(plan, window_plan=window)

    def _plan_packed(self, decode_rows: Sequence[int], chunks: Sequence[tuple[int, int]], decode_len: int,
                     chunk_len: int, chunk_block: int, pad_decode: bool, into: PackedPlan | None) -> PackedPlan:
        decode_tokens = decode_len if pad_decode else len(decode_rows)
        q_len, lens = decode_tokens + chunk_len, self.seq_lens
        rows, positions = [0] * q_len, [-1] * q_len
        rows[: len(decode_rows)] = decode_rows
        positions[: len(decode_rows)] = _decode_positions(decode_rows, lens)
        at = decode_tokens
        for row, n in chunks:
            end = lens[row]
            rows[at : at + n] = [row] * n
            positions[at : at + n] = range(end - n, end)
            at += cdiv(n, chunk_block) * chunk_block
        page_size, seq_pages, sink = self.page_size, self.seq_pages, self.sink_slot
        slots = [seq_pages[r][p // page_size] * page_size + p % page_size if p >= 0 else sink
                 for r, p in zip(rows, positions)]
        fields = (slots, rows, positions, [max(p, 0) for p in positions])
        if into is not None:
            if chunks or not pad_decode or into.q_len != q_len:
                raise ValueError(f"a static plan of {into.q_len} rows takes a padded decode-only step of as many")
            for held, values in zip((into.slots, into.tok_rows, into.tok_pos, into.position_ids), fields):
                held.view(-1).copy_(self._tensor(values))
            return into
        if device_policy(self.device).zero_copy_host_ints:  # a tensor over each field's ints: fewer ops than views of one
            slots_t, rows_t, pos_t, ids_t = (self._tensor(values) for values in fields)
        else:  # one host-to-device copy
            slots_t, rows_t, pos_t, ids_t = self._tensor([v for values in fields for v in values]).view(4, q_len)
        return PackedPlan(
            slots=slots_t.view(1, q_len),
            tok_rows=rows_t,
            tok_pos=pos_t,
            position_ids=ids_t.view(1, q_len),
            decode_rows=tuple(decode_rows),
            chunks=tuple(chunks),
            decode_len=decode_len,
            chunk_block=chunk_block,
            q_len=q_len,
            decode_tokens=decode_tokens,
        )

    # ------------------------------------------------------------------ internals
    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host values as a tensor on the table's device (``host_tensor``)."""
        return host_tensor(values, self.device, dtype)

    def _pages(self, row: int) -> list[int]:
        if not 0 <= row < self.max_batch_size or self.seq_pages[row] is None:
            raise ValueError(f"row {row} holds no sequence")
        return self.seq_pages[row]

    def _needs_copy(self, row: int, num_tokens: int) -> bool:
        """A write into a partly filled last page that is shared or registered goes to a copy."""
        pages, length = self.seq_pages[row], self.seq_lens[row]
        if num_tokens == 0 or length % self.page_size == 0:
            return False
        return self.ref_counts[pages[-1]] > 1 or pages[-1] in self.page_keys

    def _alloc(self) -> int:
        """A page for one owner: a free one, else the least recently released cached one."""
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.cached_pages.popitem(last=False)
            del self.key_pages[self.page_keys.pop(page)]
        self.ref_counts[page] = 1
        return page

    def _copy_last_page(self, row: int) -> tuple[int, int]:
        pages = self.seq_pages[row]
        src = pages[-1]
        dst = self._alloc()
        self.page_fill[dst] = self.seq_lens[row] % self.page_size
        self.live_tokens += self.page_fill[dst]
        pages[-1] = dst
        self._unref(src)  # a registered page this row held alone goes to the prefix cache
        self._set("table", (row, len(pages) - 1), dst)
        self._set("page_logical", dst, len(pages) - 1)
        return src, dst

    def _window_start(self, row: int, position: int) -> int:
        """The first page a query of ``row`` at ``position`` may attend (0 without a window)."""
        window = self.sliding_window if row >= self.max_batch_size else self.window
        return 0 if window is None else max(0, position - window + 1) // self.page_size

    def _release(self, row: int, end: int) -> None:
        """Give back the row's pages before page ``end`` that it still holds."""
        pages, start = self.seq_pages[row], self.first_held[row]
        if end <= start:
            return
        for i in range(start, end):
            page, pages[i] = pages[i], RELEASED
            self._unref(page)
        self.first_held[row] = end
        self._set("table", (row, slice(start, end)), RELEASED)

    def _mirror(self, row: int) -> None:
        """Rewrite a row's device mirrors from the host lists."""
        pages = self.seq_pages[row]
        self._set("table", row, -1)
        if pages:
            self._set("table", (row, slice(0, len(pages))), pages)
        self._set("lens", row, self.seq_lens[row])

    def _refill(self, page: int) -> None:
        """Recount a page's fill from the rows holding it (rare: after a truncation)."""
        fill, page_size = 0, self.page_size
        for row, pages in enumerate(self.seq_pages):
            for i, held in enumerate(pages or ()):
                if held == page:
                    fill = max(fill, min(page_size, self.seq_lens[row] - i * page_size))
        if self.ref_counts[page]:
            self.live_tokens += fill - self.page_fill[page]
        self.page_fill[page] = fill

    def _unref(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if page in self._uneven:  # the owner that left may have held the most tokens
            self._refill(page)
            if self.ref_counts[page] <= 1:
                self._uneven.discard(page)
        if self.ref_counts[page] == 0:
            self.live_tokens -= self.page_fill[page]
            if page in self.page_keys:  # keeps its K/V and logical index until evicted
                self.cached_pages[page] = None
            else:
                self.free_pages.append(page)
                self._set("page_logical", page, -1)
                self.page_fill[page] = 0
