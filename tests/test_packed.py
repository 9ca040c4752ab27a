"""Ragged (packed) steps: decode tokens and prefill chunks of different sequences in one
query row, against per-sequence reference attention on contiguous K/V."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import make_cache, reference_attention, rounded

import flexpage
from flexpage import masks, mods
from flexpage.core import quant

HQ, HKV, D, PAGE = 8, 2, 32, 16
DECODE_LEN, CHUNK_LEN = 4, 96  # the step's static regions: one compile per variant


def _ragged_step(decode_ctx, chunks, window, cap, seed, decode_len=DECODE_LEN, chunk_len=CHUNK_LEN, kv_dtype=None):
    """Rows 0..k-1 decode one token after ``decode_ctx[i]`` cached tokens; the next rows run a
    prefill chunk of ``n`` tokens after ``c`` cached ones, for ``(c, n)`` in ``chunks``. With a
    quantised ``kv_dtype`` the reference attends the K/V as rounded by quantising them."""
    torch.manual_seed(seed)
    cache = make_cache(PAGE, 64, HKV, D, max_batch_size=8, seed=seed, kv_dtype=kv_dtype)
    rows = [cache.add_sequence() for _ in range(len(decode_ctx) + len(chunks))]
    before = list(decode_ctx) + [c for c, _ in chunks]
    new = [1] * len(decode_ctx) + [n for _, n in chunks]
    keys = [torch.randn(HKV, b + n, D) for b, n in zip(before, new)]
    values = [torch.randn(HKV, b + n, D) for b, n in zip(before, new)]
    for row, b, k, v in zip(rows, before, keys, values):  # the cached context, one row at a time
        if b:
            cache.begin_step([row], [b])
            cache.update(k[None, :, :b], v[None, :, :b], 0)
    plan = cache.begin_packed_step(rows[: len(decode_ctx)], list(zip(rows[len(decode_ctx) :], new[len(decode_ctx) :])),
                                   decode_len, chunk_len)
    packed_k = torch.zeros(1, HKV, plan.q_len, D)
    packed_v = torch.zeros_like(packed_k)
    query = torch.randn(1, HQ, plan.q_len, D)
    for i, row in enumerate(rows):
        at = (plan.tok_rows == row) & (plan.tok_pos >= 0)
        packed_k[0][:, at], packed_v[0][:, at] = keys[i][:, before[i] :], values[i][:, before[i] :]
    k_pool, v_pool = cache.update(packed_k, packed_v, 0)
    mask = masks.PackedBlockMask.for_step(cache.page_table, plan)
    out = flexpage.packed_attention(query, k_pool, v_pool, mask, window=window, cap=cap)
    mask_mod = None if window is None else mods.sliding_window(window)
    score_mod = None if cap is None else mods.softcap(cap)
    for i, row in enumerate(rows):
        at = (plan.tok_rows == row) & (plan.tok_pos >= 0)
        q_pos = plan.tok_pos[at]
        k, v = (keys[i], values[i]) if kv_dtype is None else (rounded(keys[i], kv_dtype), rounded(values[i], kv_dtype))
        ref = reference_attention(query[0][:, at], k, v, q_pos, 0, mask_mod, score_mod)
        torch.testing.assert_close(out[0][:, at].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()  # padding positions included
    return cache, plan, mask


@pytest.mark.parametrize("window, cap", [(None, None), (24, None), (None, 2.0)])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    decode_ctx=st.lists(st.integers(1, 120), min_size=0, max_size=DECODE_LEN),
    chunks=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 40)), min_size=1, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_ragged_step_matches_per_sequence_reference(window, cap, decode_ctx, chunks, seed):
    _ragged_step(decode_ctx, chunks, window, cap, seed)


def test_decode_only_and_chunk_only_steps():
    cache, plan, mask = _ragged_step([5, 16, 77], [], None, None, seed=1, chunk_len=0)
    # three decode tokens are three positions; only attention's rows are padded to the bucket
    assert plan.q_len == 3 and cache.page_table.seq_lens[:3] == [6, 17, 78]
    assert mask.region("decode")[2].kv_num_blocks.shape[0] == DECODE_LEN
    cache, plan, _ = _ragged_step([], [(0, 33), (17, 30)], None, None, seed=2, decode_len=0)
    # chunks start on 16-token block boundaries: 33 tokens take 3 blocks, the next chunk starts at 48
    assert plan.tok_pos[:33].tolist() == list(range(33)) and plan.tok_pos[33:48].eq(-1).all()
    assert plan.tok_pos[48:78].tolist() == list(range(17, 47))
    assert (plan.slots[0, plan.tok_pos < 0] == cache.page_table.sink_slot).all()


@pytest.mark.parametrize("window", [None, 24])
def test_a_lone_sequence_region_is_attended_over_its_pages_without_block_metadata(window):
    """A lone decode token and a lone chunk (after 100 cached tokens) take SDPA over their pages on CPU."""
    for decode_ctx, chunks in (([], [(100, 37)]), ([40], []), ([40], [(0, 20)])):
        _, _, mask = _ragged_step(decode_ctx, chunks, window, None, seed=4, decode_len=len(decode_ctx),
                                  chunk_len=CHUNK_LEN if chunks else 0)
        assert not any(key[0] in ("decode", "chunk") for key in mask._variants)  # no FlexAttention region built


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("fed, window, own_split", [(1, None, False), (1, 2050, False), (5, None, False),
                                                    (5, None, True)])
def test_a_sequence_attends_a_few_long_runs_of_pages_where_they_lie(kv_dtype, fed, window, own_split):
    """A lone sequence's decode token, or its chunk of 5 tokens (a verification), whose keys lie in
    two long runs of consecutive pages (its first tokens, then pages after another sequence's)
    attends them run by run, nothing gathered, equal to the reference over contiguous K/V; the
    chunk's own tokens may straddle the runs."""
    cache = make_cache(PAGE, 160, HKV, D, kv_dtype=kv_dtype)
    cache.page_table.free_pages = deque(range(160))  # pages handed out in order
    a, b = cache.add_sequence(), cache.add_sequence()
    keys, values = torch.randn(HKV, 2100, D), torch.randn(HKV, 2100, D)
    # b's pages come after a's first ``split`` tokens; with ``own_split`` the chunk's first token still
    # fills a's partly written page before them and the others go after them
    split = 2100 - fed if own_split else 1200
    for row, start, end in ((a, 0, split), (b, 0, 50), (a, split, 2100 - fed)):
        if end > start:
            cache.begin_step([row], [end - start])
            cache.update(keys[None, :, start:end], values[None, :, start:end], 0)
    if fed == 1:
        plan = cache.begin_packed_step([a], [], 1, 0)
    else:
        plan = cache.begin_packed_step([], [(a, fed)], 0, fed, 1)
    k_pool, v_pool = cache.update(keys[None, :, 2100 - fed :], values[None, :, 2100 - fed :], 0)
    mask = masks.PackedBlockMask.for_step(cache.page_table, plan)
    query = torch.randn(1, HQ, fed, D)
    out = flexpage.packed_attention(query, k_pool, v_pool, mask, window=window)
    (kv,) = [mask.decode_kv(window)] if fed == 1 else mask.chunk_kvs(window)
    assert kv.slots is None and kv.start is None and len(kv.runs) == 2
    k, v = (keys, values) if kv_dtype is None else (rounded(keys, kv_dtype), rounded(values, kv_dtype))
    mask_mod = None if window is None else mods.sliding_window(window)
    ref = reference_attention(query[0], k, v, torch.arange(2100 - fed, 2100), 0, mask_mod)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_layout_that_does_not_fit_leaves_cache_unchanged():
    cache = make_cache(PAGE, 8, HKV, D)
    rows = [cache.add_sequence() for _ in range(3)]
    cache.begin_step(rows[:1], [20])
    free, lens = list(cache.page_table.free_pages), list(cache.page_table.seq_lens)
    with pytest.raises(ValueError, match="block-aligned"):
        cache.begin_packed_step([rows[0]], [(rows[1], 17), (rows[2], 16)], 1, 32)
    with pytest.raises(ValueError, match="decode region"):
        cache.begin_packed_step(rows[:2], [], 1, 0)
    with pytest.raises(flexpage.OutOfPagesError):
        cache.begin_packed_step([rows[0]], [(rows[1], 100)], 1, 112)
    assert list(cache.page_table.free_pages) == free and cache.page_table.seq_lens == lens


def test_grouped_decode_rows_list_their_own_pages():
    """CPU decode rows with grouped query heads (attention template) list exactly their own
    pages, full ones unmasked; plain one-token rows (decoding template) list equal counts."""
    cache, plan, mask = _ragged_step([5, 40, 100], [], None, None, seed=3, chunk_len=0)
    lens = [6, 41, 101]  # the context plus the step's token
    grouped = mask.region("decode", group=HQ // HKV)[2]
    listed = grouped.kv_num_blocks[:3, 0, 0] + grouped.full_kv_num_blocks[:3, 0, 0]
    assert listed.tolist() == [-(-n // PAGE) for n in lens]
    assert grouped.full_kv_num_blocks[:3, 0, 0].tolist() == [n // PAGE for n in lens]
    assert (grouped.kv_num_blocks[3:] + grouped.full_kv_num_blocks[3:]).eq(0).all()  # the padding row
    plain = mask.region("decode")[2]
    assert (plain.kv_num_blocks + plain.full_kv_num_blocks).eq(-(-max(lens) // PAGE)).all()


@pytest.mark.parametrize("group", [1, HQ // HKV])
def test_static_decode_step_rewrites_its_tensors_in_place_and_attends_like_the_reference(group):
    """A compiled bucket's step inputs (``PageTable.static_plan`` + ``StaticDecodeMask``) serve
    successive decode steps of different rows and lengths: each step's attention equals the
    reference over each row's contiguous K/V, for every layer variant, and no tensor moves. A row
    listed ``m`` times feeds its last ``m`` tokens, each attending causally (a speculating sequence
    verifying drafts): beside other rows (FlexAttention) or alone (SDPA over its pages)."""
    torch.manual_seed(group)
    cache = make_cache(PAGE, 64, HKV, D, max_batch_size=8, seed=group)
    rows = [cache.add_sequence() for _ in range(5)]
    keys, values = {}, {}
    for row, length in zip(rows, (3, 40, 17, 100, 64)):  # cached context, scattered pages
        keys[row], values[row] = torch.randn(HKV, length, D), torch.randn(HKV, length, D)
        cache.begin_step([row], [length])
        cache.update(keys[row][None], values[row][None], 0)
    variants = {(None, None), (24, None), (None, 2.0)}
    plan = cache.page_table.static_plan(DECODE_LEN)
    mask = masks.StaticDecodeMask.over(cache.page_table, plan, variants, group)
    addresses = [t.data_ptr() for t in mask.tensors()]
    steps = ([rows[0], rows[1], rows[3]], [rows[4], rows[2], rows[1], rows[0]], [rows[3]],
             [rows[1], rows[3], rows[3], rows[3]], [rows[2], rows[2], rows[2]])
    for step in steps:
        cache.reserve(list(dict.fromkeys(step)), [step.count(row) for row in dict.fromkeys(step)])
        assert cache.begin_packed_step(step, [], DECODE_LEN, 0, 1, pad_decode=True, into=plan, reserved=True) is plan
        mask.refresh(step)
        new_k, new_v = torch.randn(1, HKV, DECODE_LEN, D), torch.randn(1, HKV, DECODE_LEN, D)
        k_pool, v_pool = cache.update(new_k, new_v, 0)
        query = torch.randn(1, HQ, DECODE_LEN, D)
        positions = []
        for i, row in enumerate(step):
            positions.append(keys[row].shape[1])
            keys[row] = torch.cat([keys[row], new_k[0, :, i : i + 1]], 1)
            values[row] = torch.cat([values[row], new_v[0, :, i : i + 1]], 1)
        assert plan.tok_pos[: len(step)].tolist() == positions
        for window, cap in variants:
            out = flexpage.packed_attention(query, k_pool, v_pool, mask, window=window, cap=cap)
            mask_mod = None if window is None else mods.sliding_window(window)
            score_mod = None if cap is None else mods.softcap(cap)
            for i, row in enumerate(step):
                q_pos = torch.tensor([positions[i]])
                ref = reference_attention(query[0][:, i : i + 1], keys[row], values[row], q_pos, 0, mask_mod, score_mod)
                torch.testing.assert_close(out[0][:, i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)
        assert [t.data_ptr() for t in mask.tensors()] == addresses


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("decode_ctx, chunks, window, cap", [
    ([5, 40, 100], [(17, 30)], None, None),  # decode rows: the C kernel over the stored bytes; a chunk: SDPA
    ([5, 40, 100], [], 24, None),
    ([77], [(100, 37)], None, None),  # a lone decode token (the C kernel) and a chunk (SDPA, dequantised as gathered)
    ([3, 60], [(0, 20)], None, 2.0),  # soft-capped: every region through FlexAttention over the dequantised scratch
])
def test_quantised_pages_attend_like_the_reference_over_their_rounded_values(kv_dtype, decode_ctx, chunks, window,
                                                                              cap):
    """Over int8 / float8 pages, a ragged step's attention equals the reference over contiguous K/V
    rounded as quantising them rounds them (each token's scale its own): quantisation is the only
    difference, whichever kernel reads the pages. The pages' unwritten slots hold garbage, and so
    does FlexAttention's scratch pool wherever this step does not write it."""
    pool = make_cache(PAGE, 64, HKV, D, kv_dtype=kv_dtype).layers[0].keys  # garbage, quantised
    every_slot = torch.arange(pool.shape[2])
    for name in ("keys", "values"):
        quant.dequantised_pool(pool, every_slot, torch.float32, name)
    _ragged_step(decode_ctx, chunks, window, cap, seed=5, decode_len=max(len(decode_ctx), 1),
                 chunk_len=CHUNK_LEN if chunks else 0, kv_dtype=kv_dtype)
