"""PagedKVCache: pools, slot writes, copy-on-write, stats, and bad input."""

import pytest
import torch
from reference import make_cache, write_step
from transformers import LlamaConfig
from transformers.cache_utils import Cache

import flexpage
from flexpage import OutOfPagesError, PagedKVCache, zoo
from flexpage.core.step_shape import StepShape

D = 8


def kv(hkv, n, fill=None):
    t = torch.randn(hkv, n, D)
    return t if fill is None else torch.full_like(t, fill)


def test_built_from_a_transformers_config():
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cache = PagedKVCache(config, page_size=16, num_pages=10, max_batch_size=2)
    assert isinstance(cache, Cache) and len(cache.layers) == 3
    assert cache.layers[0].keys.shape == (1, 2, 11 * 16, 16)  # + sink page; head_dim = 64 / 4


def test_windowed_layers_keep_their_window_in_window_rows_of_the_global_layers_pools():
    """Gemma 2-shaped (layer 0 attends 32 positions back, layer 1 every position): the windowed
    layer's K/V go to the row's window row, in the global layer's pool tensors (the bytes of the
    same tokens in two pools of their own), and never overwrite the global layer's; the window
    row gives back the pages before its window while the row keeps every page."""
    config = zoo.load_config("gemma2-tiny")
    heads, dim = config.num_key_value_heads, config.head_dim
    cache = PagedKVCache(config, page_size=16, num_pages=flexpage.core.cache.pages_for_tokens(config, 128, 16),
                         max_batch_size=2)
    plain = PagedKVCache(num_layers=2, num_kv_heads=heads, head_dim=dim, page_size=16, num_pages=8, max_batch_size=2)
    assert cache.windowed == {0} and cache.page_table.sliding_window == config.sliding_window == 32
    assert cache.layers[0].keys is cache.layers[1].keys and len(cache.pool_layers) == 1
    assert cache.page_table.num_pages * cache.bytes_per_token == plain.page_table.num_pages * plain.bytes_per_token
    with pytest.raises(ValueError, match="packed steps"):
        cache.begin_step([cache.add_sequence()], [1])
    row = cache.add_sequence()
    written = {0: [], 1: []}
    for n in (40, *[1] * 30):  # a prefill chunk, then one token a step
        cache.begin_packed_step([row] if n == 1 else [], [] if n == 1 else [(row, n)], n == 1, 0 if n == 1 else n, 1)
        for layer in (0, 1):
            keys, values = torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)
            cache.update(keys, values, layer)
            written[layer].append(keys[0])
        if n == 40:  # every token still held by both rows
            torch.testing.assert_close(cache.gather(0, row)[0], written[0][0], rtol=0, atol=0)
    torch.testing.assert_close(cache.gather(1, row)[0], torch.cat(written[1], 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="gave back"):
        cache.gather(0, row)
    pt, window_row = cache.page_table, cache.page_table.window_row(row)
    first = pt.first_held[window_row]
    assert first == (70 - 1 - 32 + 1) // 16 and len(pt.seq_pages[window_row]) - first <= 3
    slots = pt.slots_of(pt.seq_pages[window_row][first:])[: 70 - first * 16]
    torch.testing.assert_close(cache.layers[0].keys[0, :, slots], torch.cat(written[0], 1)[:, first * 16 :],
                               rtol=0, atol=0)
    cache.free_sequence(row)
    assert cache.stats().pages_used == 0 and cache.stats().live_tokens == 0  # both rows gave every page back


def test_a_shared_window_page_given_back_in_the_step_that_copies_it_is_copied_intact():
    """A fork (truncated to one token) shares its row's first window page; in one step the fork
    writes into that page (so it gets a copy) while the row's window moves past it (so the row gives
    it back): the page is free when the step is planned, and the copy, made before anything is
    written, still holds its K/V."""
    config = zoo.load_config("gemma2-tiny")  # layer 0 attends 32 positions back, layer 1 every position
    heads, dim = config.num_key_value_heads, config.head_dim
    cache = PagedKVCache(config, page_size=16, num_pages=16, max_batch_size=2)
    row = cache.add_sequence()
    cache.begin_packed_step([], [(row, 47)], 0, 47, 1)
    prompt = [torch.randn(1, heads, 47, dim) for _ in range(2)]
    for layer in (0, 1):
        cache.update(prompt[layer], prompt[layer], layer)
    fork = cache.fork(row)
    pt = cache.page_table
    pt.truncate(fork, 1)
    shared = pt.seq_pages[pt.window_row(fork)][0]
    assert shared == pt.seq_pages[pt.window_row(row)][0] and pt.ref_counts[shared] == 2
    cache.begin_packed_step([fork, row], [], 2, 0, 1)  # the row's next query (47) sees from position 16 on
    assert pt.ref_counts[shared] == 0 and pt.first_held[pt.window_row(row)] == 1  # given back, then free
    step = [torch.randn(1, heads, 2, dim) for _ in range(2)]
    for layer in (0, 1):
        cache.update(step[layer], step[layer], layer)
    for layer in (0, 1):  # the fork: the prompt's first token, then its own
        want = torch.cat([prompt[layer][0, :, :1], step[layer][0, :, :1]], 1)
        torch.testing.assert_close(cache.gather(layer, fork)[0], want, rtol=0, atol=0)


def test_written_tokens_read_back_through_pages():
    cache = make_cache(16, 12, 2, D)
    a, b = cache.add_sequence(), cache.add_sequence()
    ka, va, kb, vb = kv(2, 37), kv(2, 37), kv(2, 5), kv(2, 5)
    write_step(cache, [a, b], [ka[:, :30], kb], [va[:, :30], vb])
    write_step(cache, [a], [ka[:, 30:]], [va[:, 30:]])
    ga, gva = cache.gather(0, a)
    assert torch.equal(ga, ka) and torch.equal(gva, va)
    assert torch.equal(cache.gather(0, b)[0], kb)


def test_stats_count_live_tokens_and_shared_pages_once():
    cache = make_cache(16, 12, 2, D)
    a = cache.add_sequence()
    write_step(cache, [a], [kv(2, 20)], [kv(2, 20)])
    s = cache.stats()
    assert (s.pages_total, s.pages_used, s.pages_free, s.live_tokens, s.reserved_slots) == (12, 2, 10, 20, 32)
    assert s.utilisation == pytest.approx(20 / 32)
    cache.fork(a)
    assert cache.stats().live_tokens == 20 and cache.stats().pages_used == 2


def test_fork_copies_shared_partial_page_before_writing():
    cache = make_cache(16, 12, 2, D)
    a = cache.add_sequence()
    k0, v0 = kv(2, 20), kv(2, 20)
    write_step(cache, [a], [k0], [v0])
    b = cache.fork(a)
    write_step(cache, [b], [kv(2, 1, 7.0)], [kv(2, 1, 7.0)])  # writes into the shared partial page
    assert torch.equal(cache.gather(0, a)[0], k0)  # the original row is untouched
    kb, _ = cache.gather(0, b)
    assert torch.equal(kb[:, :20], k0) and (kb[:, 20] == 7.0).all()
    assert cache.page_table.pages_of(a)[0] == cache.page_table.pages_of(b)[0]


def test_out_of_pages_leaves_cache_byte_for_byte_unchanged():
    cache = make_cache(16, 4, 2, D)
    a, b = cache.add_sequence(), cache.add_sequence()
    write_step(cache, [a], [kv(2, 40)], [kv(2, 40)])
    pools = [t.clone() for t in (cache.layers[0].keys, cache.layers[0].values)]
    pt = cache.page_table
    before = (list(pt.free_pages), list(pt.ref_counts), [list(p or []) for p in pt.seq_pages], list(pt.seq_lens),
              pt.table.clone(), pt.lens.clone(), pt.page_logical.clone())
    with pytest.raises(OutOfPagesError):
        write_step(cache, [a, b], [kv(2, 1), kv(2, 40)], [kv(2, 1), kv(2, 40)])
    after = (list(pt.free_pages), list(pt.ref_counts), [list(p or []) for p in pt.seq_pages], list(pt.seq_lens),
             pt.table.clone(), pt.lens.clone(), pt.page_logical.clone())
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, after))
    assert torch.equal(pools[0], cache.layers[0].keys) and torch.equal(pools[1], cache.layers[0].values)
    write_step(cache, [b], [kv(2, 16)], [kv(2, 16)])  # a request that fits still succeeds


@pytest.mark.parametrize("page_size", [0, 8, 24, 48, 100, 16.0, True])
def test_page_size_must_be_a_legal_kv_block(page_size):
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=D, page_size=page_size, num_pages=4, max_batch_size=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype=torch.float64), "dtype"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(device=["cpu", "cpu"]), "device"),
    ],
)
def test_bad_cache_arguments(kwargs, match):
    args = dict(num_layers=1, num_kv_heads=2, head_dim=D, page_size=16, num_pages=4, max_batch_size=1) | kwargs
    with pytest.raises(ValueError, match=match):
        PagedKVCache(**args)


def test_update_rejects_wrong_shapes_and_unknown_rows():
    cache = make_cache(16, 4, 2, D)
    a = cache.add_sequence()
    cache.begin_step([a], [3])
    with pytest.raises(ValueError, match="key/value states must have shape"):
        cache.update(torch.zeros(1, 4, 3, D), torch.zeros(1, 4, 3, D), 0)  # 4 heads, cache has 2
    with pytest.raises(ValueError, match="holds no sequence"):
        cache.begin_step([5], [1])


def test_paged_attention_rejects_mismatched_inputs():
    cache = make_cache(16, 4, 2, D)
    a = cache.add_sequence()
    plan, (kp, vp) = write_step(cache, [a], [kv(2, 3)], [kv(2, 3)])
    bm = flexpage.build_block_mask(cache.page_table, plan)
    cases = [
        (torch.zeros(1, 3, 3, D), "multiple of key_pool heads"),
        (torch.zeros(1, 4, 3, D, dtype=torch.bfloat16), "dtype"),
        (torch.zeros(1, 4, 3, D + 1), "head_dim"),
        (torch.zeros(2, 4, 3, D), "batch"),
        (torch.zeros(4, 3, D), "4-D"),
    ]
    for query, match in cases:
        with pytest.raises(ValueError, match=match):
            flexpage.paged_attention(query, kp, vp, bm)


def test_batch_step_that_cannot_claim_rows_leaks_none():
    cache = flexpage.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=D, page_size=16, num_pages=8,
                                  max_batch_size=2)
    cache.add_sequence()  # 1 of 2 rows taken: a batch of 2 cannot get rows
    with pytest.raises(OutOfPagesError, match="rows are in use"):
        cache.begin_batch_step([3, 3], 3, StepShape(sdpa=True))
    assert cache.page_table.active_rows == [0] and cache.batch_rows == [] and cache.get_seq_length() == 0


def test_compiled_write_updates_the_pool_in_place():
    """A compiled forward (``wrap(compile_decode=True)``) writes its tokens into the pools in
    place: inductor allocates no pool-sized buffer to copy the pool back through."""
    import re

    from torch._inductor.utils import run_and_get_code

    from flexpage.core.cache import PagedLayer

    layer = PagedLayer(1000, 2, D, torch.float32, torch.device("cpu"))  # 1000 slots: a size nothing else has

    def write(slots, keys, values):
        layer.write(slots, keys, values)
        return layer.keys.sum()

    keys, values = torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D)
    _, code = run_and_get_code(torch.compile(write, fullgraph=True, dynamic=False), torch.tensor([[5], [700]]),
                               keys, values)
    buffers = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", "\n".join(code))
    assert buffers and not [shape for shape in buffers if "1000" in shape]  # only the small outputs
    assert torch.equal(layer.keys[0, :, [5, 700]], keys[:, :, 0].transpose(0, 1))
    assert torch.equal(layer.values[0, :, [5, 700]], values[:, :, 0].transpose(0, 1))
    assert layer.keys[0, :, 6].abs().sum() == 0  # nothing else written
