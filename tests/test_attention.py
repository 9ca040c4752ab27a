"""Paged attention against scaled_dot_product_attention on the equivalent contiguous tensors.

Each case fixes the shapes (one compile) and hypothesis varies the data: lengths (including
1 and lengths that are not multiples of the page size), where pages land in a shuffled
pool, and the chunk offsets. Batch rows are deliberately not 0..B-1.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from attention_cases import HEAD_DIM, MAX_CONTEXT, MAX_NEW, ROWS, run_case
from reference import GARBAGE, make_cache, reference_attention, write_step

import flexpage
from flexpage import mods
from flexpage.core import attention
from flexpage.bench.measure import compiled_graphs
from flexpage.core.compile import AOT_ENV, compile_static

# (mode, page_size, mod, dtype, q_heads, kv_heads): one compile each
CASES = [
    ("decode", 16, "causal", torch.float32, 8, 2),
    ("decode", 32, "sliding", torch.float32, 8, 2),
    ("decode", 64, "softcap", torch.float32, 8, 2),
    ("decode", 128, "alibi", torch.float32, 8, 2),
    ("decode", 16, "prefix_lm", torch.float32, 8, 2),
    ("decode", 16, "causal", torch.float32, 4, 1),
    ("prefill", 16, "causal", torch.float32, 8, 2),
    ("prefill", 32, "sliding", torch.float32, 8, 2),
    ("prefill", 64, "softcap", torch.float32, 8, 2),
    ("prefill", 128, "prefix_lm", torch.float32, 8, 2),
    ("prefill", 16, "alibi", torch.float32, 4, 4),
    ("chunked", 16, "causal", torch.float32, 8, 2),
    ("chunked", 64, "sliding", torch.float32, 8, 2),
    ("decode", 16, "causal", torch.bfloat16, 8, 2),
    ("prefill", 32, "causal", torch.bfloat16, 8, 2),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@st.composite
def lengths(draw, mode):
    max_new, max_ctx = MAX_NEW[mode], MAX_CONTEXT[mode]
    news = [draw(st.integers(1, max_new)) for _ in ROWS]
    low = 1 if mode == "decode" else 0
    contexts = [draw(st.integers(low, max_ctx) | st.sampled_from([low, 15, 16, 17, 64])) for _ in ROWS]
    if mode == "prefill":
        contexts = [0] * len(ROWS)
    if mode == "decode":  # a row of length 1 (its first token)
        contexts[draw(st.integers(0, len(ROWS) - 1))] = draw(st.sampled_from([0, 1, 15]))
    return contexts, news


@pytest.mark.parametrize("mode, page_size, mod, dtype, hq, hkv", CASES, ids=lambda v: str(v).replace("torch.", ""))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_paged_attention_matches_sdpa(mode, page_size, mod, dtype, hq, hkv, data):
    contexts, news = data.draw(lengths(mode))
    seed = data.draw(st.integers(0, 2**16))
    for out, ref in run_case(mode, page_size, mod, dtype, hq, hkv, contexts, news, seed):
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max().item() <= TOLERANCE[dtype]


def test_results_do_not_depend_on_where_pages_land():
    contexts, news = [40, 1, 133], [1, 1, 1]
    first, second = (run_case("decode", 16, "causal", torch.float32, 8, 2, contexts, news, 0, placement)
                     for placement in (1, 2))
    for (out_a, _), (out_b, _) in zip(first, second):
        assert torch.equal(out_a, out_b)


def test_custom_scale():
    for out, ref in run_case("decode", 16, "softcap", torch.float32, 8, 2, [40, 1, 133], [1, 1, 1], 3, scale=0.7):
        assert (out - ref).abs().max() <= 1e-5


def test_unwritten_slots_of_last_page_are_never_read():
    # length 17 with page 16: the second page holds 1 live token and 15 garbage slots
    (out, ref), *_ = run_case("decode", 16, "prefix_lm", torch.float32, 8, 2, [16, 3, 2], [1, 1, 1], seed=5)
    assert GARBAGE > 100 * out.abs().max()
    assert (out - ref).abs().max() <= 1e-5


def test_block_mask_lists_only_own_pages_and_is_not_pool_sized_off_cpu():
    cache = make_cache(16, 64, 2, HEAD_DIM)
    for row in ROWS:
        cache.add_sequence(row)
    plan, _ = write_step(cache, ROWS, [torch.randn(2, n, HEAD_DIM) for n in (5, 37, 130)],
                         [torch.randn(2, n, HEAD_DIM) for n in (5, 37, 130)])
    bm = flexpage.build_block_mask(cache.page_table, plan)
    pt = cache.page_table
    for b, row in enumerate(ROWS):
        for r in range(bm.kv_num_blocks.shape[2]):
            n_full, n_part = bm.full_kv_num_blocks[b, 0, r].item(), bm.kv_num_blocks[b, 0, r].item()
            listed = bm.full_kv_indices[b, 0, r, :n_full].tolist() + bm.kv_indices[b, 0, r, :n_part].tolist()
            assert listed == pt.pages_of(row)[: len(listed)]  # own pages, logical order, no duplicates
    assert flexpage.masks.metadata_width(pt) == pt.num_pages + 1  # CPU template needs the pool's width
    meta = flexpage.PageTable(4096, 16, 8, max_pages_per_seq=128, device="meta")
    assert flexpage.masks.metadata_width(meta) == 128  # elsewhere: batch x pages-per-sequence


def test_no_recompiles_across_decode_lengths_1_to_2048():
    batch, hq, hkv = 2, 8, 2
    cache = make_cache(16, 2 * 2048 // 16 + 2, hkv, HEAD_DIM, max_batch_size=batch)
    rows = [cache.add_sequence() for _ in range(batch)]
    query = torch.randn(batch, hq, 1, HEAD_DIM)

    def step():
        plan, (kp, vp) = write_step(cache, rows, [torch.randn(hkv, 1, HEAD_DIM)] * batch,
                                    [torch.randn(hkv, 1, HEAD_DIM)] * batch)
        return flexpage.paged_attention(query, kp, vp, flexpage.build_block_mask(cache.page_table, plan))

    step()  # warm-up: length 1
    graphs = compiled_graphs()
    for _ in range(2047):
        out = step()
    assert cache.seq_length(rows[0]) == 2048
    assert compiled_graphs() == graphs
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("window", [None, 24])
@settings(max_examples=8, deadline=None)
@given(context=st.integers(0, 300) | st.sampled_from([0, 15, 16, 23, 24]), seed=st.integers(0, 2**16))
def test_sequence_attention_of_a_decode_token_matches_sdpa(window, context, seed):
    """A lone sequence's CPU decode step attends its pages with SDPA, wherever they landed."""
    torch.manual_seed(seed)
    cache = make_cache(16, 25, 2, HEAD_DIM, seed=seed)  # a shuffled pool: pages are gathered
    row = cache.add_sequence(ROWS[0])
    keys, values = torch.randn(2, 2, context + 1, HEAD_DIM)
    if context:
        write_step(cache, [row], [keys[:, :-1]], [values[:, :-1]])
    plan, (kp, vp) = write_step(cache, [row], [keys[:, -1:]], [values[:, -1:]])
    query = torch.randn(1, 8, 1, HEAD_DIM)
    out = flexpage.sequence_attention(query, kp, vp, flexpage.SequenceKV.for_row(cache.page_table, row, window))
    ref = reference_attention(query[0], keys, values, torch.tensor([context]), 0, mods.sliding_window(window) if window else None)
    assert (out[0] - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [None, 24])
@settings(max_examples=6, deadline=None)
@given(context=st.integers(1, 200), n=st.integers(2, 70), seed=st.integers(0, 2**16))
def test_sequence_attention_of_a_chunk_after_cached_tokens_matches_sdpa(window, context, n, seed):
    """A prefill chunk after cached tokens: without a window it is two unmasked calls (earlier
    keys whole, its own keys causally) merged by log-sum-exp; with one, a masked call."""
    torch.manual_seed(seed)
    cache = make_cache(16, 25, 2, HEAD_DIM, seed=seed)
    row = cache.add_sequence(ROWS[0])
    keys, values = torch.randn(2, 2, context + n, HEAD_DIM)
    write_step(cache, [row], [keys[:, :context]], [values[:, :context]])
    _, (kp, vp) = write_step(cache, [row], [keys[:, context:]], [values[:, context:]])
    kv = flexpage.SequenceKV.for_row(cache.page_table, row, window, queries=n)
    if window is None:
        assert kv.allowed is None and kv.causal and kv.earlier == context
    query = torch.randn(1, 8, n, HEAD_DIM)
    ref = reference_attention(query[0], keys, values, torch.arange(context, context + n), 0,
                              mods.sliding_window(window) if window else None)
    assert (flexpage.sequence_attention(query, kp, vp, kv)[0] - ref).abs().max() <= 1e-5
    if window is None:  # the single masked call used off CPU
        off_cpu = F.scaled_dot_product_attention(query, keys[None], values[None], enable_gqa=True,
                                                 attn_mask=attention.causal_after(n, context))
        assert (off_cpu[0] - ref).abs().max() <= 1e-5


def test_sequence_attention_reads_a_contiguous_sequence_in_place():
    cache = flexpage.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=HEAD_DIM, page_size=16, num_pages=32,
                                  max_batch_size=2)
    row = cache.add_sequence()
    k, v = torch.randn(2, 2, 50, HEAD_DIM)
    write_step(cache, [row], [k[:, :49]], [v[:, :49]])
    plan, (kp, vp) = write_step(cache, [row], [k[:, 49:]], [v[:, 49:]])
    kv = flexpage.SequenceKV.for_row(cache.page_table, row, 24)
    assert kv.slots is None and kv.start == 26 and kv.width == 24  # the last 24 tokens, a slice of the pool
    query = torch.randn(1, 8, 1, HEAD_DIM)
    ref = reference_attention(query[0], k, v, torch.tensor([49]), 0, mods.sliding_window(24))
    assert (flexpage.sequence_attention(query, kp, vp, kv)[0] - ref).abs().max() <= 1e-5


def test_compiled_kernels_keep_their_graph_limit_on_other_threads(monkeypatch):
    """Since torch 2.12 dynamo's config is per thread: where kernels compile through dynamo (no
    ahead-of-time compile), an Engine built or stepped on a thread other than the one that
    imported flexpage must still get more than dynamo's default 8 graphs."""
    monkeypatch.setenv(AOT_ENV, "0")
    double = compile_static(lambda x: x * 2)
    errors = []

    def shapes() -> None:
        try:
            for n in range(1, 11):
                x = torch.arange(float(n))
                assert torch.equal(double(x), x * 2)
        except BaseException as error:  # reported on the test's thread
            errors.append(error)

    worker = threading.Thread(target=shapes)
    worker.start()
    worker.join()
    assert errors == []
