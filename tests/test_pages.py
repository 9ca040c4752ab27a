"""Page allocator invariants under random operation sequences (hypothesis state machine)."""

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flexpage import OutOfPagesError, PageTable
from flexpage.core.pages import RELEASED, WINDOW_KEY

NUM_PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ = 12, 16, 5, 8
WINDOW = 24  # a sliding window of a page and a half


def snapshot(pt: PageTable):
    return (
        list(pt.free_pages),
        list(pt.cached_pages),
        dict(pt.page_keys),
        list(pt.ref_counts),
        copy.deepcopy(pt.seq_pages),
        list(pt.seq_lens),
        pt.table.clone(),
        pt.page_logical.clone(),
        pt.lens.clone(),
        list(pt.page_fill),
        pt.live_tokens,
        list(pt.first_held),
    )


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pt = PageTable(NUM_PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ)
        self.tokens: dict[int, list[int]] = {}  # each row's token ids (what its pages hold)
        self.page_content: dict[int, tuple] = {}  # what each page holds, by its slots' token ids
        self.key_tokens: dict[bytes, tuple] = {}  # content key -> the tokens it names

    def rows(self) -> list[int]:
        """Every row in use, window rows (``PageTable.sliding_window``) included."""
        return [r for row in self.pt.active_rows for r in self.pt.rows_of(row)]

    def named(self, key: bytes) -> tuple:
        """The tokens a content key names (a window page's key: its row's page's key + ``WINDOW_KEY``)."""
        return self.key_tokens[key] if key in self.key_tokens else self.key_tokens[key.removesuffix(WINDOW_KEY)]

    def key(self, tokens: list[int], index: int) -> bytes:
        """Content key of page ``index``: every token up to its end (exact, like the Engine's hash chain)."""
        prefix = tuple(tokens[: (index + 1) * PAGE_SIZE])
        key = repr(prefix).encode()
        self.key_tokens[key] = prefix
        return key

    @precondition(lambda self: len(self.pt.active_rows) < ROWS)
    @rule()
    def add(self):
        row = self.pt.add_sequence()
        assert self.pt.pages_of(row) == [] and self.pt.seq_lens[row] == 0
        self.tokens[row] = []

    @precondition(lambda self: len(self.pt.active_rows) < ROWS and self.pt.page_keys)
    @rule(data=st.data(), extra=st.integers(0, 2))
    def admit_with_cached_prefix(self, data, extra):
        """A new row whose tokens start like a registered page chain (and maybe go on differently)."""
        key = data.draw(st.sampled_from(sorted(k for k in self.pt.key_pages if k in self.key_tokens)))
        tokens = list(self.key_tokens[key]) + [data.draw(st.integers(0, 3)) for _ in range(extra * PAGE_SIZE)]
        pages = self.pt.lookup([self.key(tokens, i) for i in range(len(tokens) // PAGE_SIZE)])
        row = self.pt.add_sequence()
        self.pt.attach(row, pages)
        self.tokens[row] = tokens[: len(pages) * PAGE_SIZE]
        for i, page in enumerate(pages):  # a hit serves exactly the tokens asked for
            assert self.page_content[page] == tuple(tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])

    @precondition(lambda self: any(self.pt.seq_lens[r] >= PAGE_SIZE for r in self.pt.active_rows))
    @rule(data=st.data())
    def register_full_pages(self, data):
        row = data.draw(st.sampled_from([r for r in self.pt.active_rows if self.pt.seq_lens[r] >= PAGE_SIZE]))
        for i in range(self.pt.seq_lens[row] // PAGE_SIZE):
            self.pt.register(row, i, self.key(self.tokens[row], i))

    @precondition(lambda self: self.pt.active_rows)
    @rule(data=st.data(), n=st.integers(0, 40))
    def extend(self, data, n):
        rows = data.draw(st.lists(st.sampled_from(self.pt.active_rows), min_size=1, max_size=3, unique=True))
        counts = [n] + [data.draw(st.integers(0, 20)) for _ in rows[1:]]
        before = snapshot(self.pt)
        old_lens = {r: self.pt.seq_lens[r] for r in rows}
        try:
            copies = self.pt.extend(rows, counts)
        except OutOfPagesError:
            assert_same(before, snapshot(self.pt))  # all or nothing
            return
        held_before, cached_before = before[3], before[1]
        for i, (src, dst) in enumerate(copies):
            # the source held live K/V when the step began (a row's, or the prefix cache's) and no copy
            # before it wrote over it: the cache makes the copies in order before anything is written,
            # so a source given back in this very step (a window row past it) is still intact
            assert held_before[src] >= 1 or src in cached_before
            assert src not in {d for _, d in copies[:i]} and self.pt.ref_counts[dst] == 1
            self.page_content[dst] = self.page_content.get(src, ())  # the cache copies the page's K/V
        for row, count in zip(rows, counts):
            assert self.pt.seq_lens[row] == old_lens[row] + count
            new = [data.draw(st.integers(0, 3)) for _ in range(count)]
            for held in self.pt.rows_of(row):  # a window row is written the same tokens
                pages = self.pt.seq_pages[held]
                for pos, token in zip(range(old_lens[row], old_lens[row] + count), new):
                    page = pages[pos // PAGE_SIZE]
                    # every page written into is this row's alone and not registered: shared pages never change
                    assert self.pt.ref_counts[page] == 1 and page not in self.pt.page_keys
                    content = list(self.page_content.get(page, ()))[: pos % PAGE_SIZE]
                    self.page_content[page] = tuple(content + [token])
            self.tokens[row] = self.tokens[row] + new

    @precondition(lambda self: self.pt.active_rows)
    @rule(data=st.data())
    def free(self, data):
        row = data.draw(st.sampled_from(self.pt.active_rows))
        self.pt.free_sequence(row)
        del self.tokens[row]

    @precondition(lambda self: self.pt.active_rows and len(self.pt.active_rows) < ROWS)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self.pt.active_rows))
        dst = self.pt.fork(src)
        self.tokens[dst] = list(self.tokens[src])
        assert self.pt.pages_of(dst) == self.pt.pages_of(src)
        assert self.pt.seq_lens[dst] == self.pt.seq_lens[src]

    @precondition(lambda self: self.pt.active_rows)
    @rule(data=st.data())
    def truncate(self, data):
        row = data.draw(st.sampled_from(self.pt.active_rows))
        length = data.draw(st.integers(0, self.pt.seq_lens[row]))
        before = snapshot(self.pt)
        try:
            self.pt.truncate(row, length)
        except ValueError:  # only where the window that length needs was given back; nothing changed
            assert any(self.pt.first_held[r] > 0 for r in self.pt.rows_of(row))
            assert_same(before, snapshot(self.pt))
            return
        self.tokens[row] = self.tokens[row][:length]

    def held(self, row):
        """``(logical index, page)`` of the pages ``row`` (or a window row) still holds."""
        return [(i, page) for i, page in enumerate(self.pt.seq_pages[row]) if page != RELEASED]

    @invariant()
    def live_tokens_count_each_held_page_once(self):
        pt, filled = self.pt, {}
        for row in self.rows():
            for i, page in self.held(row):
                filled[page] = max(filled.get(page, 0), min(PAGE_SIZE, pt.seq_lens[row] - i * PAGE_SIZE))
        assert pt.live_tokens == sum(filled.values())

    @invariant()
    def pages_free_or_owned_and_counted(self):
        pt = self.pt
        owners = [0] * NUM_PAGES
        for row in self.rows():
            for _, page in self.held(row):
                owners[page] += 1
        assert owners == pt.ref_counts
        free, cached = list(pt.free_pages), list(pt.cached_pages)
        assert len(free) == len(set(free)) and not set(free) & set(cached)
        assert set(free) | set(cached) == {p for p in range(NUM_PAGES) if owners[p] == 0}
        assert set(cached) <= set(pt.page_keys)  # a cached page is a registered page nobody holds
        assert {pt.key_pages[k] for k in pt.page_keys.values()} == set(pt.page_keys)

    @invariant()
    def rows_hold_their_tokens(self):
        for row in self.pt.active_rows:
            for held in self.pt.rows_of(row):
                for i, page in self.held(held):
                    expect = tuple(self.tokens[row][i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
                    assert self.page_content[page][: len(expect)] == expect
        for page, key in self.pt.page_keys.items():
            assert self.page_content[page] == self.named(key)[-PAGE_SIZE:]

    @invariant()
    def device_mirrors_match_host(self):
        pt = self.pt
        for row in range(len(pt.seq_pages)):
            pages = pt.seq_pages[row] or []
            expect = pages + [-1] * (PAGES_PER_SEQ - len(pages))
            assert pt.table[row].tolist() == expect
            assert pt.lens[row].item() == (pt.seq_lens[row] if pt.seq_pages[row] is not None else 0)
            assert len(pages) == -(-pt.seq_lens[row] // PAGE_SIZE)
            for i, page in enumerate(pages):
                assert pt.page_logical[page].item() == i if page != RELEASED else i < pt.first_held[row]
        for page in pt.free_pages:
            assert pt.page_logical[page].item() == -1
        for page, key in pt.page_keys.items():  # cached pages keep their place in the sequence
            assert pt.page_logical[page].item() == len(self.named(key)) // PAGE_SIZE - 1

    def teardown(self):
        for row in self.pt.active_rows:
            self.pt.free_sequence(row)
        assert self.pt.num_free_pages == NUM_PAGES and not any(self.pt.ref_counts)  # nothing leaked
        assert len(self.pt.free_pages) + len(self.pt.cached_pages) == NUM_PAGES


TestPageTableMachine = PageTableMachine.TestCase
TestPageTableMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class TensorMirrorMachine(PageTableMachine):
    """The same rules with the device mirrors written by tensor ops, as on an accelerator (a CPU
    table writes them through NumPy views)."""

    def __init__(self):
        super().__init__()
        self.pt._host = {}


TestTensorMirrorMachine = TensorMirrorMachine.TestCase
TestTensorMirrorMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


class WindowedPageTableMachine(PageTableMachine):
    """The same rules where every query attends at most ``WINDOW`` positions back: rows give back
    the pages wholly before their earliest query's window, and nothing else changes."""

    def __init__(self):
        super().__init__()
        self.pt.window = WINDOW

    @invariant()
    def a_row_holds_exactly_its_pages_from_the_first_one_kept(self):
        pt = self.pt
        for row in pt.active_rows:
            pages, first = pt.pages_of(row), pt.first_held[row]
            assert all(page == RELEASED for page in pages[:first])
            assert all(page != RELEASED for page in pages[first:])
            # the next query (at the row's length) sees every key it may attend
            assert first <= max(0, pt.seq_lens[row] - WINDOW + 1) // PAGE_SIZE


TestWindowedPageTableMachine = WindowedPageTableMachine.TestCase
TestWindowedPageTableMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


class LayerGroupPageTableMachine(PageTableMachine):
    """The same rules where some layers attend ``WINDOW`` positions back and the others everything:
    each row's window row (its windowed layers' pages) grows, forks, truncates, registers and frees
    with it from the one pool and gives back the pages before its window; the rows keep every page."""

    def __init__(self):
        super().__init__()
        self.pt = PageTable(NUM_PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ, sliding_window=WINDOW)

    @invariant()
    def a_window_row_holds_its_rows_tokens_from_the_first_page_it_keeps(self):
        pt = self.pt
        for row in pt.active_rows:
            window_row = pt.window_row(row)
            pages, first = pt.seq_pages[window_row], pt.first_held[window_row]
            assert pt.seq_lens[window_row] == pt.seq_lens[row] and len(pages) == len(pt.pages_of(row))
            assert all(page == RELEASED for page in pages[:first])
            assert all(page != RELEASED for page in pages[first:])
            assert first <= max(0, pt.seq_lens[row] - WINDOW + 1) // PAGE_SIZE
            assert pt.first_held[row] == 0  # the global layers' rows give nothing back


TestLayerGroupPageTableMachine = LayerGroupPageTableMachine.TestCase
TestLayerGroupPageTableMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_window_rows_hold_their_window_while_their_rows_keep_every_page():
    """Layer groups (Gemma 2): a row's window row takes pages from the same pool as it grows and
    gives back those before its window; budgets, forks, prefix hits and freeing cover both."""
    pt = PageTable(24, PAGE_SIZE, ROWS, 16, sliding_window=WINDOW)
    row = pt.add_sequence()
    window_row = pt.window_row(row)
    assert pt.pages_needed(row, 40) == 6  # three pages for each of the two rows
    pt.extend([row], [40])
    assert pt.num_free_pages == 24 - 6 and pt.seq_lens[window_row] == 40
    for _ in range(100):  # one token a step
        pt.extend([row], [1])
        held = [p for p in pt.seq_pages[window_row] if p != RELEASED]
        assert len(held) <= pt.window_pages(pt.seq_lens[row]) == -(-WINDOW // PAGE_SIZE) + 1
        assert RELEASED not in pt.pages_of(row)
    assert pt.num_free_pages == 24 - len(pt.pages_of(row)) - len(held)  # the rest went back to the pool
    for i in range(len(pt.pages_of(row)) - 1):
        pt.register(row, i, bytes([i]))
    child = pt.fork(row)
    assert pt.seq_pages[pt.window_row(child)] == pt.seq_pages[window_row]
    # a prefix hit needs the window pages beside its pages: registered while the window row held them
    assert len(pt.lookup([bytes([i]) for i in range(8)])) == 0  # page 0's window page was given back unregistered
    pt.free_sequence(child)
    with pytest.raises(ValueError, match="given back"):
        pt.truncate(row, 20)
    pt.free_sequence(row)
    assert pt.num_free_pages == 24 and not any(pt.ref_counts)
    # registered while held: a later row attaches both rows' pages
    first = pt.add_sequence()
    pt.extend([first], [2 * PAGE_SIZE])
    pt.register(first, 0, b"a")
    pt.register(first, 1, b"b")
    hit = pt.lookup([b"a", b"b", b"c"])
    second = pt.add_sequence()
    assert pt.unowned(hit) == 0
    pt.attach(second, hit)
    assert pt.pages_of(second) == pt.pages_of(first)
    assert pt.seq_pages[pt.window_row(second)] == pt.seq_pages[pt.window_row(first)]
    assert pt.seq_lens[pt.window_row(second)] == 2 * PAGE_SIZE


def test_fork_then_write_copies_shared_partial_page():
    pt = PageTable(8, 16, 4)
    a = pt.add_sequence()
    pt.extend([a], [20])  # one full page, one partial
    b = pt.fork(a)
    shared_last = pt.pages_of(a)[1]
    copies = pt.extend([b], [1])
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert pt.pages_of(b)[0] == pt.pages_of(a)[0]  # full page still shared
    assert pt.pages_of(b)[1] != shared_last and pt.pages_of(a)[1] == shared_last
    assert pt.ref_counts[shared_last] == 1


def test_fork_at_page_boundary_needs_no_copy():
    pt = PageTable(8, 16, 4)
    a = pt.add_sequence()
    pt.extend([a], [32])
    b = pt.fork(a)
    assert pt.extend([b], [1]) == []
    assert pt.pages_of(b)[:2] == pt.pages_of(a)


def test_exhaustion_raises_and_changes_nothing():
    pt = PageTable(4, 16, 2)
    a, b = pt.add_sequence(), pt.add_sequence()
    pt.extend([a], [40])
    before = snapshot(pt)
    with pytest.raises(OutOfPagesError, match="free pages"):
        pt.extend([a, b], [8, 20])  # a fits in its last page, b needs 2 pages: 2 > 1 free
    assert_same(before, snapshot(pt))


def test_per_sequence_page_budget():
    pt = PageTable(16, 16, 2, max_pages_per_seq=2)
    a = pt.add_sequence()
    with pytest.raises(OutOfPagesError, match="at most 2 pages"):
        pt.extend([a], [33])
    assert pt.pages_of(a) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_pages=0, page_size=16, max_batch_size=1), "num_pages"),
        (dict(num_pages=4, page_size=16, max_batch_size=0), "max_batch_size"),
        (dict(num_pages=4, page_size=16, max_batch_size=1, max_pages_per_seq=5), "max_pages_per_seq"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageTable(**kwargs)


def test_bad_rows_and_counts():
    pt = PageTable(4, 16, 2)
    a = pt.add_sequence()
    with pytest.raises(ValueError, match="holds no sequence"):
        pt.extend([1], [1])
    with pytest.raises(ValueError, match="distinct"):
        pt.extend([a, a], [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        pt.extend([a], [-1])
    with pytest.raises(ValueError, match="already in use"):
        pt.add_sequence(a)
    pt.add_sequence()
    with pytest.raises(OutOfPagesError, match="rows are in use"):
        pt.add_sequence()


def test_plan_slots_follow_pages_and_padding_goes_to_sink():
    pt = PageTable(8, 16, 4)
    pt.free_pages.rotate(3)  # pages no longer start at 0
    a, b = pt.add_sequence(), pt.add_sequence()
    pt.extend([a, b], [18, 3])
    plan = pt.plan([b, a], [3, 18])
    assert plan.q_len == 18 and plan.kv_lens.tolist() == [3, 18]
    pa, pb = pt.pages_of(a), pt.pages_of(b)
    expect_a = [pa[i // 16] * 16 + i % 16 for i in range(18)]
    expect_b = [pt.sink_slot] * 15 + [pb[0] * 16 + i for i in range(3)]
    assert plan.slots[1].tolist() == expect_a
    assert plan.slots[0].tolist() == expect_b
    assert plan.q_start.tolist() == [3 - 18, 0]


def test_prefix_pages_are_reused_then_evicted_least_recent_first():
    pt = PageTable(6, 16, 4)
    a = pt.add_sequence()
    pt.extend([a], [40])  # pages: 2 full + 1 partial
    full = pt.pages_of(a)[:2]
    for i in range(2):
        pt.register(a, i, f"k{i}".encode())
    with pytest.raises(ValueError, match="not full"):
        pt.register(a, 2, b"k2")
    pt.free_sequence(a)
    assert pt.num_free_pages == 6 and list(pt.cached_pages) == full[::-1]  # the chain's tail goes first
    b = pt.add_sequence()
    assert pt.lookup([b"k0", b"k1", b"k2"]) == full and pt.lookup([b"k1"]) == [full[1]]
    pt.attach(b, pt.lookup([b"k0"]))  # b shares the first page only
    assert pt.seq_lens[b] == 16 and pt.ref_counts[full[0]] == 1 and list(pt.cached_pages) == [full[1]]
    copies = pt.extend([b], [76])  # 5 more pages: the 4 free ones, then the cached page is evicted
    assert copies == [] and full[1] in pt.pages_of(b) and pt.lookup([b"k0", b"k1"]) == [full[0]]
    with pytest.raises(OutOfPagesError):
        pt.extend([b], [40])
    pt.truncate(b, 8)  # a write into the registered first page now goes to a private copy
    (src, dst), = pt.extend([b], [1])
    assert src == full[0] and pt.pages_of(b) == [dst] and full[0] in pt.cached_pages


@pytest.mark.parametrize("values, dtype", [([5, -1, 2**40], torch.int64), ([7, 0, -3], torch.int32), ([], torch.int64)])
def test_host_tensor_equals_torch_tensor_and_owns_its_ints(values, dtype):
    """A step's index tensors wrap their ints' buffer on the CPU: same values, dtype and shape as
    ``torch.tensor``, valid after the caller's list is gone, and independent of later ones."""
    from flexpage.core.host import host_tensor

    tensor = host_tensor(list(values), torch.device("cpu"), dtype)
    other = host_tensor([v + 1 for v in values], torch.device("cpu"), dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert tensor.dtype == dtype and tensor.shape == expected.shape and torch.equal(tensor, expected)
    assert torch.equal(other, expected + 1)


def test_room_and_unowned_pages_as_the_scheduler_asks():
    """``room``: the tokens a row's last page and some free pages hold; ``unowned``: cached pages
    no sequence holds any more (attaching them takes them off the free list)."""
    pt = PageTable(8, 16, 4)
    row = pt.add_sequence()
    assert pt.room(row, 2) == 32
    pt.extend([row], [21])  # 2 pages, 11 slots left in the second
    assert pt.room(row, 0) == 11 and pt.room(row, 3) == 11 + 48
    pt.register(row, 0, b"first page")
    (cached,) = pt.lookup([b"first page"])
    assert pt.unowned([cached]) == 0  # its sequence still holds it
    pt.free_sequence(row)
    free = pt.num_free_pages
    assert pt.unowned([cached]) == 1
    other = pt.add_sequence()
    pt.attach(other, [cached])
    assert pt.unowned([cached]) == 0 and pt.num_free_pages == free - 1


def test_a_windowed_row_gives_back_the_pages_before_its_window_as_it_grows():
    pt = PageTable(NUM_PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ)
    pt.window = WINDOW
    row, other = pt.add_sequence(), pt.add_sequence()
    pt.extend([row], [40])  # the step's earliest query (position 0) sees from page 0: nothing given back
    assert pt.first_held[row] == 0 and pt.num_free_pages == NUM_PAGES - 3
    for _ in range(60):  # one token a step: a query at position p sees keys from p - 23
        pt.extend([row], [1])
        length = pt.seq_lens[row]
        held = [p for p in pt.pages_of(row) if p != RELEASED]
        assert pt.first_held[row] == max(0, length - 1 - WINDOW + 1) // PAGE_SIZE
        assert len(held) <= -(-WINDOW // PAGE_SIZE) + 1  # the window's pages and the one written
    assert pt.num_free_pages == NUM_PAGES - len(held)  # given back to the pool, for other rows
    assert pt.table[row, : pt.first_held[row]].eq(RELEASED).all()
    pt.extend([other], [16 * 6])  # takes pages the first row gave back
    with pytest.raises(ValueError, match="given back"):
        pt.truncate(row, 40)
    pt.truncate(row, pt.seq_lens[row] - 3)  # a rollback within the window (rejected drafts) is fine
    pt.free_sequence(row)
    pt.free_sequence(other)
    assert pt.num_free_pages == NUM_PAGES and not any(pt.ref_counts)
