"""Page allocator invariants under random operation sequences (hypothesis state machine)."""

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flexpage import OutOfPagesError, PageTable

NUM_PAGES, PAGE_SIZE, ROWS, PAGES_PER_SEQ = 12, 16, 5, 8


def snapshot(pt: PageTable):
    return (
        list(pt.free_pages),
        list(pt.ref_counts),
        copy.deepcopy(pt.seq_pages),
        list(pt.seq_lens),
        pt.table.clone(),
        pt.page_logical.clone(),
        pt.lens.clone(),
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
        self.written: dict[int, set[int]] = {}  # pages a row wrote tokens into (must be private)

    @precondition(lambda self: len(self.pt.active_rows) < ROWS)
    @rule()
    def add(self):
        row = self.pt.add_sequence()
        assert self.pt.pages_of(row) == [] and self.pt.seq_lens[row] == 0

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
        for src, dst in copies:
            assert self.pt.ref_counts[src] >= 1 and self.pt.ref_counts[dst] == 1
        for row, count in zip(rows, counts):
            assert self.pt.seq_lens[row] == old_lens[row] + count
            # every page this step writes into is owned by this row alone (copy-on-write)
            pages = self.pt.pages_of(row)
            for pos in range(old_lens[row], old_lens[row] + count):
                assert self.pt.ref_counts[pages[pos // PAGE_SIZE]] == 1

    @precondition(lambda self: self.pt.active_rows)
    @rule(data=st.data())
    def free(self, data):
        self.pt.free_sequence(data.draw(st.sampled_from(self.pt.active_rows)))

    @precondition(lambda self: self.pt.active_rows and len(self.pt.active_rows) < ROWS)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self.pt.active_rows))
        dst = self.pt.fork(src)
        assert self.pt.pages_of(dst) == self.pt.pages_of(src)
        assert self.pt.seq_lens[dst] == self.pt.seq_lens[src]

    @invariant()
    def pages_free_or_owned_and_counted(self):
        pt = self.pt
        owners = [0] * NUM_PAGES
        for row in pt.active_rows:
            for page in pt.pages_of(row):
                owners[page] += 1
        assert owners == pt.ref_counts
        free = list(pt.free_pages)
        assert len(free) == len(set(free))
        assert set(free) == {p for p in range(NUM_PAGES) if owners[p] == 0}

    @invariant()
    def device_mirrors_match_host(self):
        pt = self.pt
        for row in range(ROWS):
            pages = pt.seq_pages[row] or []
            expect = pages + [-1] * (PAGES_PER_SEQ - len(pages))
            assert pt.table[row].tolist() == expect
            assert pt.lens[row].item() == (pt.seq_lens[row] if pt.seq_pages[row] is not None else 0)
            assert len(pages) == -(-pt.seq_lens[row] // PAGE_SIZE)
            for i, page in enumerate(pages):
                assert pt.page_logical[page].item() == i
        for page in pt.free_pages:
            assert pt.page_logical[page].item() == -1

    def teardown(self):
        for row in self.pt.active_rows:
            self.pt.free_sequence(row)
        assert self.pt.num_free_pages == NUM_PAGES and not any(self.pt.ref_counts)  # nothing leaked


TestPageTableMachine = PageTableMachine.TestCase
TestPageTableMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


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
