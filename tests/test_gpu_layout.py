"""Every BlockMask flexpage builds satisfies FlexAttention's GPU (Triton) constraints, checked on
CPU so that no GPU has to see an invalid mask: query blocks a multiple of 16 tokens (a decode
row's one query sits in one block), KV block = page size, kernel tiles that divide both blocks
(whatever default tile PyTorch would pick, up to 128 x 128), and on a GPU block metadata as wide
as a sequence's page budget, never the pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reference import make_cache

from flexpage import masks
from flexpage.core.attention import kernel_options
from flexpage.core.masks import PackedBlockMask
from flexpage.core.step_shape import StepShape

PAGE = 16
VARIANTS = [(None, None), (24, None), (None, 30.0)]  # (window, soft-cap)


def gpu_violations(mask, page_size: int) -> list[str]:
    """Why a BlockMask would be refused by FlexAttention's GPU kernels (empty: it would not)."""
    q_block, kv_block = mask.BLOCK_SIZE
    found = []
    if q_block % 16:
        found.append(f"query block of {q_block} tokens is not a multiple of 16")
    if kv_block != page_size:
        found.append(f"KV block of {kv_block} differs from the page size {page_size}")
    if mask.kv_num_blocks.shape[1] != 1:
        found.append("the mask is not shared by every head")
    q_len = mask.seq_lengths[0]
    options = kernel_options(torch.empty(1, 1, q_len, 8, device="meta"), mask.BLOCK_SIZE)  # as on a GPU
    if q_len > 1:  # the FlexAttention kernel (one-token rows take the decode kernel, which fits its own tiles)
        if not options or not options.get("FORCE_USE_FLEX_ATTENTION"):
            found.append(f"a {q_len}-token query would be routed to the decode kernel")
        tile_m, tile_n = (options or {}).get("BLOCK_M", 128), (options or {}).get("BLOCK_N", 128)
        if q_block % tile_m or kv_block % tile_n or min(tile_m, tile_n) < 16:
            found.append(f"tiles {tile_m}x{tile_n} do not divide blocks {q_block}x{kv_block}")
    return found


def test_violations_are_detected():
    bad = SimpleNamespace(BLOCK_SIZE=(1, 32), kv_num_blocks=torch.zeros(1, 1, 1), seq_lengths=(1, 64))
    assert len(gpu_violations(bad, PAGE)) == 2
    untiled = SimpleNamespace(BLOCK_SIZE=(16, 8), kv_num_blocks=torch.zeros(1, 1, 1), seq_lengths=(32, 64))
    assert any("tiles" in v for v in gpu_violations(untiled, 8))  # an 8-token page fits no tile


def test_generate_prefill_and_decode_masks():
    cache = make_cache(PAGE, 64, 2, 32, max_batch_size=4)
    gpu = StepShape(sdpa=False)  # a GPU's steps: every region attended by FlexAttention
    for counts, columns, region in (([20, 9], 20, "chunk"), ([1, 1], 1, "decode")):  # a left-padded prefill, then decode
        plan = cache.begin_batch_step(counts, columns, gpu)
        mask = PackedBlockMask.for_step(cache.page_table, plan)
        for window, cap in VARIANTS:
            assert gpu_violations(mask.region(region, window, cap)[2], PAGE) == []


@pytest.mark.parametrize("decode_len, chunk_len", [(4, 96), (2, 64), (0, 64)])
def test_engine_region_masks(decode_len, chunk_len):
    cache = make_cache(PAGE, 64, 2, 32, max_batch_size=8)
    rows = [cache.add_sequence() for _ in range(4)]
    for row, n in zip(rows, (30, 5, 50, 12)):  # cached context
        cache.begin_step([row], [n])
    decoding = rows[: min(2, decode_len)]
    plan = cache.begin_packed_step(decoding, [(rows[2], 20), (rows[3], 7)], decode_len, chunk_len)
    mask = PackedBlockMask.for_step(cache.page_table, plan)
    for window, cap in VARIANTS:
        for name in ("decode", "chunk") if decode_len else ("chunk",):
            start, end, block_mask, _ = mask.region(name, window, cap)
            assert gpu_violations(block_mask, PAGE) == [], (name, window, cap)
            if name == "decode":  # one-token rows, each with its own pages
                assert block_mask.kv_num_blocks.shape[0] == decode_len and block_mask.seq_lengths[0] == 1


def test_gpu_metadata_width_follows_the_page_budget_not_the_pool():
    for pool_pages in (64, 4096, 1 << 20):
        table = SimpleNamespace(device=torch.device("cuda"), num_pages=pool_pages, max_pages_per_seq=128)
        assert masks.metadata_width(table) == 128
    cpu = SimpleNamespace(device=torch.device("cpu"), num_pages=4096, max_pages_per_seq=128)
    assert masks.metadata_width(cpu) == 4097  # inductor's CPU template needs the whole pool listed
