"""Paged attention cases shared by the CPU, compile and CUDA tests: a step over scattered pages of a
shuffled pool, with its reference (SDPA over the same tokens, contiguous)."""

from __future__ import annotations

import torch
from reference import make_cache, reference_attention, write_step

import flexpage
from flexpage import mods

ROWS = [3, 7, 1]  # active batch rows that are not 0..B-1
HEAD_DIM = 32
PREFIX_LENS = torch.tensor([7, 1, 40], dtype=torch.int32)  # prefix-LM prefix per batch index


def alibi_mod(num_heads, device):
    mod = mods.alibi(mods.alibi_slopes(num_heads).to(device))
    mod.additive = True  # the reference may fold it into SDPA's float mask
    return mod


# (mask_mod, score_mod) for ``q_heads`` query heads, their tensors on ``device``
MODS = {
    "causal": lambda hq, device: (None, None),
    "sliding": lambda hq, device: (mods.sliding_window(24), None),
    "prefix_lm": lambda hq, device: (mods.prefix_lm(PREFIX_LENS.to(device)), None),
    "softcap": lambda hq, device: (None, mods.softcap(2.0)),
    "alibi": lambda hq, device: (None, alibi_mod(hq, device)),
}

MAX_CONTEXT = {"decode": 300, "prefill": 0, "chunked": 200}
MAX_NEW = {"decode": 1, "prefill": 150, "chunked": 40}

def run_case(mode, page_size, mod, dtype, hq, hkv, contexts, news, seed, placement_seed=None, scale=None,
             device="cpu"):
    """Write random contexts, then run one step of ``news[b]`` new tokens; return (out, reference) rows.

    ``seed`` draws the tensors, ``placement_seed`` (default: ``seed``) the shuffle of the pool;
    the cache and the kernel run on ``device``, the reference on the CPU.
    """
    torch.manual_seed(seed)
    q_len = MAX_NEW[mode]
    num_pages = len(ROWS) * -(-(MAX_CONTEXT[mode] + q_len) // page_size) + 5
    cache = make_cache(page_size, num_pages, hkv, HEAD_DIM, dtype, seed=seed if placement_seed is None else placement_seed,
                       device=device)
    for row in ROWS:
        cache.add_sequence(row)
    total = [c + n for c, n in zip(contexts, news)]
    keys = [torch.randn(hkv, t, HEAD_DIM).to(dtype) for t in total]
    values = [torch.randn(hkv, t, HEAD_DIM).to(dtype) for t in total]
    if any(contexts):
        write_step(cache, ROWS, [k[:, :c] for k, c in zip(keys, contexts)], [v[:, :c] for v, c in zip(values, contexts)])
    plan, (k_pool, v_pool) = write_step(
        cache, ROWS, [k[:, c:] for k, c in zip(keys, contexts)], [v[:, c:] for v, c in zip(values, contexts)], q_len
    )
    mask_mod, score_mod = MODS[mod](hq, device)
    ref_mask_mod, ref_score_mod = MODS[mod](hq, "cpu")
    query = torch.randn(len(ROWS), hq, q_len, HEAD_DIM).to(dtype)
    block_mask = flexpage.build_block_mask(cache.page_table, plan, mask_mod)
    assert block_mask.BLOCK_SIZE[1] == page_size  # a KV block never spans two pages
    paged_score = flexpage.paged_score_mod(cache.page_table, plan, score_mod) if score_mod else None
    out = flexpage.paged_attention(query.to(device), k_pool, v_pool, block_mask, paged_score, scale=scale).cpu()
    results = []
    for b, (c, n) in enumerate(zip(contexts, news)):
        q_pos = torch.arange(c, c + n)
        ref = reference_attention(query[b, :, q_len - n :], keys[b], values[b], q_pos, b, ref_mask_mod, ref_score_mod,
                                  scale)
        results.append((out[b, :, q_len - n :].float(), ref.float()))
    return results
