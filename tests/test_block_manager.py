"""BlockManager at its boundaries, without a model: a step's rows grow by exactly its new tokens, all
or nothing; the page budgets the scheduler asks for agree with what reserving then takes; prefixes
are found by content and attached; forks share pages copy-on-write; truncating and freeing give
pages back and keep every count consistent. Page counts are worked out by hand (16-token pages)."""

from __future__ import annotations

import pytest
import torch

from flexpage import OutOfPagesError
from flexpage.engine.sequence import Batch, Sequence
from reference import make_blocks, page_state


def prompt(length, start=3):
    """Distinct tokens from ``start``: prompts from different starts share no page."""
    return list(range(start, start + length))


def admitted(blocks, index, tokens):
    """A sequence given a row from its cached prefix, as the scheduler admits one."""
    seq = Sequence(index, list(tokens), len(tokens))
    blocks.allocate(seq, blocks.cached_prefix(seq))
    return seq


def compute(blocks, seq, n):
    """A prefill chunk of ``n`` tokens reserved, then computed and its full pages registered (as the
    scheduler's schedule and postprocess do)."""
    blocks.reserve(Batch(chunks=[(seq, n)]))
    seq.num_computed += n
    blocks.register(seq)


def decoding(blocks, index, length, start=3):
    """A sequence whose prompt of ``length`` tokens is computed and whose first output token is pending."""
    seq = admitted(blocks, index, prompt(length, start))
    compute(blocks, seq, length)
    seq.tokens.append(1)
    return seq


def test_reserve_grows_each_row_by_its_new_tokens():
    """A decode token is 1, a chunk its tokens, a verification the last token and its drafts."""
    blocks = make_blocks()
    pt = blocks.cache.page_table
    decode, verify = decoding(blocks, 0, 20, 100), decoding(blocks, 1, 10, 200)
    chunk = admitted(blocks, 2, prompt(40, 300))
    verify.drafts = [7, 8, 9]
    assert blocks.num_free_pages == 16 - 2 - 1
    blocks.reserve(Batch(decode=[decode], chunks=[(chunk, 17)], verify=[verify]))
    assert [pt.seq_lens[s.row] for s in (decode, chunk, verify)] == [21, 17, 14]
    assert [len(pt.pages_of(s.row)) for s in (decode, chunk, verify)] == [2, 2, 1]
    assert blocks.num_free_pages == 13 - 2  # only the chunk needed pages: the others fit their last page
    assert (decode.num_computed, chunk.num_computed, verify.num_computed) == (20, 0, 10)  # computed: postprocess's


def test_reserve_is_all_or_nothing_when_the_pool_runs_short():
    blocks = make_blocks(num_pages=4)
    full = decoding(blocks, 0, 16)  # its 17th token opens a second page
    other = admitted(blocks, 1, prompt(48, 100))
    before = page_state(blocks)
    with pytest.raises(OutOfPagesError):
        blocks.reserve(Batch(decode=[full], chunks=[(other, 48)]))  # 1 + 3 pages, 3 free
    assert page_state(blocks) == before  # host lists, counts and device mirrors untouched
    blocks.reserve(Batch(decode=[full], chunks=[(other, 32)]))  # 1 + 2 pages: exactly what is free
    assert blocks.num_free_pages == 0


def test_page_budgets_agree_with_what_reserve_takes():
    blocks = make_blocks(num_pages=8)
    seq = admitted(blocks, 0, prompt(20))
    compute(blocks, seq, 20)  # 2 pages, 12 slots left in the second
    assert [blocks.pages_needed(seq, n) for n in (0, 1, 12, 13, 44, 45)] == [0, 0, 0, 1, 2, 3]
    assert [blocks.tokens_fitting(seq, 100, free) for free in (0, 1, 2)] == [12, 28, 44]
    assert blocks.tokens_fitting(seq, 5, 0) == 5 and blocks.tokens_fitting(seq, 13, 0) == 12
    for n, pages in ((12, 0), (1, 1), (32, 2)):  # 20 -> 32 -> 33 -> 65 tokens: 2, 3, 5 pages
        free = blocks.num_free_pages
        assert blocks.pages_needed(seq, n) == pages
        blocks.reserve(Batch(chunks=[(seq, n)]))
        seq.num_computed += n
        assert blocks.num_free_pages == free - pages
    assert blocks.tokens_fitting(seq, 100, 0) == 15  # the rest of the fifth page


def test_tokens_fitting_counts_the_copy_of_a_shared_last_page():
    """A forked sequence's first write copies the shared partial page: one of the free pages goes to
    that copy, which still holds the rest of the page's slots."""
    blocks = make_blocks(num_pages=4)
    parent = admitted(blocks, 0, prompt(20))
    compute(blocks, parent, 20)
    child = Sequence(1, list(parent.tokens), 20)
    blocks.fork(parent, child)  # both hold 2 pages; 2 free
    assert blocks.pages_needed(child, 1) == 1 and blocks.pages_needed(child, 13) == 2
    assert blocks.tokens_fitting(child, 5, 0) == 0  # not even one token without a page for the copy
    assert [blocks.tokens_fitting(child, 100, free) for free in (1, 2)] == [12, 28]
    blocks.reserve(Batch(chunks=[(child, 12)]))
    assert blocks.num_free_pages == 1 and blocks.cache.seq_length(child.row) == 32


def test_admission_pages_count_every_token_and_revived_cached_pages():
    blocks = make_blocks(num_pages=8)
    pt = blocks.cache.page_table
    first = admitted(blocks, 0, prompt(40))
    compute(blocks, first, 40)  # pages 0 and 1 full, registered
    later = Sequence(1, prompt(32) + prompt(18, 500), 50)  # first's first 2 pages, then its own tokens
    hit = blocks.cached_prefix(later)
    assert hit == pt.pages_of(first.row)[:2]
    assert blocks.admission_pages(later, hit) == 4 - 2  # 4 pages for 50 tokens, 2 held by `first` already
    blocks.free(first)  # its registered pages stay cached, counted free
    assert blocks.num_free_pages == 8 and blocks.admission_pages(later, hit) == 4
    assert blocks.allocate(later, hit) == 2  # the cached pages it revived
    compute(blocks, later, 18)
    assert blocks.num_free_pages == 8 - 4  # what admission_pages said
    assert (later.num_computed, later.num_registered, blocks.hit_tokens) == (50, 3, 32)


def test_equal_prefixes_have_equal_keys_and_prompts_share_all_but_their_last_token():
    blocks = make_blocks()
    a = prompt(40)
    b = a[:32] + prompt(8, 500)
    c = [a[0] + 1] + a[1:]  # differs in the first token only

    def keys(tokens, num_tokens=None):
        return blocks.keys(Sequence(0, tokens, len(tokens)), len(tokens) if num_tokens is None else num_tokens)

    assert len(keys(a)) == 2 and keys(a) == keys(b) and keys(a, 31) == keys(a)[:1]
    assert keys(a)[1] != keys(c)[1]  # page 1 holds the same tokens in both, after different pages
    five, six = keys(a + [5] * 8), keys(a + [6] * 8)
    assert five[:2] == six[:2] and five[2] != six[2]  # the same first pages, another third
    # a prompt's last token is always computed (its logits pick the next token): 32 tokens share 1 page, 33 share 2
    assert [len(blocks.prompt_keys(Sequence(0, a[:n], n))) for n in (16, 17, 32, 33)] == [0, 1, 1, 2]
    assert make_blocks(prefix_caching=False).prompt_keys(Sequence(0, a, 40)) == []


def test_a_registered_prefix_is_found_and_attached():
    blocks = make_blocks()
    pt = blocks.cache.page_table
    first = admitted(blocks, 0, prompt(40))
    compute(blocks, first, 40)
    assert first.num_registered == 2  # its third page holds 8 tokens: not registered
    second = admitted(blocks, 1, prompt(32) + prompt(10, 500))
    assert pt.pages_of(second.row) == pt.pages_of(first.row)[:2] and blocks.cache.seq_length(second.row) == 32
    assert (second.num_computed, second.num_registered, second.num_pending, blocks.hit_tokens) == (32, 2, 10, 32)
    assert [pt.ref_counts[p] for p in pt.pages_of(first.row)] == [2, 2, 1]
    # a 16-token prompt reuses nothing (its last token must be computed), a 17-token one its first page
    assert admitted(blocks, 2, prompt(16)).num_computed == 0 and admitted(blocks, 3, prompt(17)).num_computed == 16
    assert blocks.hit_tokens == 48
    plain = make_blocks(prefix_caching=False)
    compute(plain, admitted(plain, 0, prompt(40)), 40)
    assert admitted(plain, 1, prompt(40)).num_computed == 0 and not plain.cache.page_table.key_pages


def test_fork_shares_pages_and_the_first_write_copies_the_shared_partial_page():
    blocks = make_blocks(num_pages=8)
    pt, layer = blocks.cache.page_table, blocks.cache.layers[0]
    parent = admitted(blocks, 0, prompt(20))
    compute(blocks, parent, 20)  # page 0 full (registered), page 1 holds 4 tokens
    torch.manual_seed(0)
    layer.keys.normal_()  # stands in for the computed K
    child = Sequence(1, list(parent.tokens), 20)
    blocks.fork(parent, child)
    first, last = pt.pages_of(parent.row)
    assert pt.pages_of(child.row) == [first, last] and [pt.ref_counts[p] for p in (first, last)] == [2, 2]
    assert blocks.num_free_pages == 8 - 2  # a fork takes no page
    assert (child.num_computed, child.num_registered, child.block_keys) == (20, 1, parent.block_keys)
    assert child.block_keys is not parent.block_keys
    computed = layer.keys[0, :, last * 16 : last * 16 + 4].clone()
    child.tokens.append(5)
    parent.tokens.append(6)
    blocks.reserve(Batch(decode=[child, parent]))
    copy = pt.pages_of(child.row)[1]
    assert pt.pages_of(child.row) == [first, copy] and pt.pages_of(parent.row) == [first, last] and copy != last
    assert blocks.num_free_pages == 8 - 3  # one copy: the parent then held its last page alone
    assert torch.equal(layer.keys[0, :, copy * 16 : copy * 16 + 4], computed)  # the copy holds the computed K


def test_truncate_gives_slots_back_and_keeps_registration_consistent():
    blocks = make_blocks(num_pages=8)
    pt = blocks.cache.page_table
    seq = decoding(blocks, 0, 48)  # 3 full pages, registered
    registered = pt.pages_of(seq.row)
    seq.drafts = [7, 8, 9, 10]
    blocks.reserve(Batch(verify=[seq]))  # 53 slots: a fourth page
    seq.num_computed += 5
    assert blocks.num_free_pages == 8 - 4
    blocks.truncate(seq, 48)  # every draft rejected
    assert (blocks.cache.seq_length(seq.row), seq.num_computed, seq.num_registered) == (48, 48, 3)
    assert blocks.num_free_pages == 8 - 3 and pt.pages_of(seq.row) == registered
    blocks.truncate(seq, 40)
    assert (blocks.cache.seq_length(seq.row), seq.num_computed, seq.num_registered) == (40, 40, 2)
    # the third page stays registered (another request still finds it) and is never written again: a copy is
    assert blocks.cached_prefix(Sequence(1, prompt(49), 49)) == registered
    assert blocks.pages_needed(seq, 1) == 1
    blocks.reserve(Batch(decode=[seq]))
    assert pt.pages_of(seq.row)[:2] == registered[:2] and pt.pages_of(seq.row)[2] != registered[2]
    assert blocks.cached_prefix(Sequence(1, prompt(49), 49)) == registered


def test_free_for_recompute_resets_the_sequence_and_keeps_its_prefix_cached():
    blocks = make_blocks(num_pages=8)
    seq = decoding(blocks, 0, 40)
    finished = decoding(blocks, 1, 20, 100)
    blocks.free(finished)
    assert finished.row is None and finished.num_computed == 20  # a finished sequence's count stays
    blocks.free(seq, recompute=True)
    assert (seq.row, seq.num_computed, seq.num_registered) == (None, 0, 0)
    assert not blocks.cache.page_table.active_rows and blocks.num_free_pages == 8
    blocks.allocate(seq, blocks.cached_prefix(seq))  # readmitted: its 41 tokens from its 2 cached pages on
    assert (seq.num_computed, seq.num_registered, seq.num_pending) == (32, 2, 9)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_pages_and_counts_return_to_the_start_once_everything_is_freed(prefix_caching):
    blocks = make_blocks(num_pages=12, prefix_caching=prefix_caching)
    pt = blocks.cache.page_table
    a = decoding(blocks, 0, 40)  # registers 2 pages
    b = admitted(blocks, 1, prompt(33) + prompt(20, 500))  # a's 2 pages (if cached), then its own
    compute(blocks, b, b.num_pending)  # 53 tokens: registers its third page
    child = Sequence(2, list(a.tokens), 40)  # a's sample: its pending token too
    blocks.fork(a, child)
    a.drafts = [4, 5, 6, 7, 8, 9, 10, 11, 12]
    blocks.reserve(Batch(decode=[child], verify=[a]))  # the child's copy of the shared page; a's drafts a page more
    child.num_computed += 1
    a.num_computed += 10
    blocks.truncate(a, 41)
    for seq in (a, b, child):
        blocks.free(seq)
    assert not pt.active_rows and pt.ref_counts == [0] * 12 and pt.live_tokens == 0
    assert blocks.num_free_pages == 12 and sorted([*pt.free_pages, *pt.cached_pages]) == list(range(12))
    assert len(pt.cached_pages) == (3 if prefix_caching else 0)  # a's 2 full pages and b's third
    assert pt.lens.tolist() == [0] * 4 and pt.table.eq(-1).all()
