"""Decode-attention micro-benchmark: paged FlexAttention vs contiguous SDPA / FlexAttention.

For each batch size and live length L, one decode step's attention (small-Llama head shape:
8 query heads, 2 KV heads, head_dim 64, page 16 unless --page-size) is timed over a 4k-token and a 64k-token
pool, side by side with SDPA and compiled flex_attention on contiguous K/V of length L, plus
the time to build the step's BlockMask. The paged call is the one flexpage makes for a batch of
one-token rows on this device (``rows_attention``: on CPU with each KV head's query heads along
the query axis); ``flex_contiguous_blocks`` runs flex_attention in that same layout over
contiguous K/V cut into KV blocks of the page size, so ``paged / flex_contiguous_blocks`` is what
the paging itself costs. Writes CSV/JSON/PNG under --out.

    flexpage bench attention            # full grid (a few minutes on 2 cores)
    flexpage bench attention --quick    # two lengths, batch 1
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from tqdm import tqdm

import flexpage
from flexpage.core.attention import query_group, rows_attention
from flexpage.core.compile import compile_static
from flexpage.bench.measure import (
    add_run_arguments, caption, finish_axes, interleaved, save_figure, machine_info, out_dir, write_records)

HQ, HKV, HEAD_DIM, PAGE = 8, 2, 64, 16


@compile_static  # a graph per shape and mask, with no cap on their number (dynamo's is 8 a function)
def contiguous_flex(query, key, value, block_mask=None, enable_gqa=False):
    return flex_attention(query, key, value, block_mask=block_mask, enable_gqa=enable_gqa)


def decode_step(capacity: int, batch: int, length: int, seed: int = 0, page_size: int = PAGE,
                huge_pages: bool = True):
    """A cache of ``capacity`` tokens holding ``batch`` rows of ``length`` tokens, after planning one
    decode step; ``huge_pages=False`` puts its pools in ``torch.zeros`` memory (4 KB pages, unless
    the system backs every large allocation with huge pages) instead of the cache's own."""
    cache = flexpage.PagedKVCache(num_layers=1, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=page_size,
                                  num_pages=capacity // page_size, max_batch_size=max(8, batch))
    if not huge_pages:
        for layer in cache.layers:
            layer.keys, layer.values = torch.zeros_like(layer.keys), torch.zeros_like(layer.values)
    free = list(cache.page_table.free_pages)
    random.Random(seed).shuffle(free)  # a fragmented pool
    cache.page_table.free_pages = type(cache.page_table.free_pages)(free)
    rows = [cache.add_sequence() for _ in range(batch)]
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, HKV, length, HEAD_DIM, generator=g) for _ in range(2))
    cache.begin_step(rows, [length - 1] * batch)
    cache.update(k[:, :, :-1], v[:, :, :-1], 0)
    plan = cache.begin_packed_step(rows, [], batch, 0, 1)  # one decode token per row, as an Engine step
    cache.update(k[:, :, -1].transpose(0, 1)[None], v[:, :, -1].transpose(0, 1)[None], 0)
    return cache, plan, k, v


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--capacities", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--page-size", type=int, default=PAGE)
    add_run_arguments(parser, "lengths 128 and 512, batch 1, 2 rounds", default="results/attention")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.batches, args.rounds, args.repeats = [128, 512], [1], 2, 5

    records = []
    grid = [(b, length) for b in args.batches for length in args.lengths]
    for batch, length in tqdm(grid, desc="decode attention"):
        query = torch.randn(batch, HQ, 1, HEAD_DIM)
        cells, errors = {}, {}
        for capacity in args.capacities:
            if batch * length > capacity:
                continue  # the pool cannot hold this batch
            cache, plan, k, v = decode_step(capacity, batch, length, page_size=args.page_size)
            kp, vp = cache.layers[0].keys, cache.layers[0].values
            pt, group = cache.page_table, query_group(query, kp)
            mask = flexpage.PackedBlockMask.for_step(pt, plan).decode_region(None, None, group)[0]
            ref = F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
            paged = lambda q=query, kp=kp, vp=vp, m=mask: rows_attention(q, kp, vp, m, None, None, group)  # noqa: E731
            errors[capacity] = (paged() - ref).abs().max().item()
            cells[f"paged_{capacity}"] = paged
            if capacity == max(args.capacities):  # the same step over pools on small pages (the same
                # seed lays its pages out as this cache's, so this step's mask fits it)
                small = decode_step(capacity, batch, length, page_size=args.page_size, huge_pages=False)[0].layers[0]
                cells[f"paged_small_pages_{capacity}"] = lambda q=query, kp=small.keys, vp=small.values, m=mask: (
                    rows_attention(q, kp, vp, m, None, None, group))
            cells[f"mask_build_{capacity}"] = lambda pt=pt, plan=plan: flexpage.PackedBlockMask.for_step(
                pt, plan).decode_region(None, None, group)
        blocks = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < length, None, None, group, length,
                                   device="cpu", BLOCK_SIZE=(flexpage.masks.Q_BLOCK_SIZE, args.page_size))
        grouped = query.view(batch, HKV, group, HEAD_DIM) if group > 1 else query
        cells["sdpa_contiguous"] = lambda: F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
        cells["flex_contiguous"] = lambda: contiguous_flex(query, k, v, enable_gqa=True)
        cells["flex_contiguous_blocks"] = lambda: contiguous_flex(grouped, k, v, block_mask=blocks, enable_gqa=group == 1)
        timings = interleaved(cells, rounds=args.rounds, repeats=args.repeats)
        for name, timing in timings.items():
            capacity = int(name.rsplit("_", 1)[1]) if name[-1].isdigit() else None
            records.append({
                "batch": batch, "length": length, "config": name.rsplit("_", 1)[0] if capacity else name,
                "capacity": capacity, "median_ms": round(timing.median_ms, 5), "remeasured": timing.remeasured,
                "max_abs_err_vs_sdpa": errors.get(capacity) if name == f"paged_{capacity}" else None,
            })
    meta = {"machine": machine_info(), "command": " ".join(sys.argv), "heads": [HQ, HKV], "head_dim": HEAD_DIM, "page_size": args.page_size,
            "rounds": args.rounds, "repeats": args.repeats, "dtype": "float32"}
    stem = os.path.join(out_dir(args), "bench_attention" if args.page_size == PAGE else f"bench_attention_page{args.page_size}")
    write_records(stem, records, meta)
    plot(records, meta, stem + ".png")
    print_summary(records)
    print(f"wrote {stem}.csv, .json, .png")


def _series(records, batch, config, capacity=None):
    rows = sorted((r for r in records if r["batch"] == batch and r["config"] == config and r["capacity"] == capacity),
                  key=lambda r: r["length"])
    return [r["length"] for r in rows], [r["median_ms"] for r in rows]


def plot(records: list[dict], meta: dict, path: str) -> None:
    """ms per decode step vs live length, one panel per batch size, into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in records})
    capacities = sorted({r["capacity"] for r in records if r["capacity"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for capacity in capacities:
            ax.plot(*_series(records, batch, "paged", capacity), "o-", label=f"flexpage paged, {capacity // 1024}k pool")
            ax.plot(*_series(records, batch, "paged_small_pages", capacity), "o:",
                    label=f"flexpage paged, {capacity // 1024}k pool on 4 KB memory pages")
            ax.plot(*_series(records, batch, "mask_build", capacity), "x:", label=f"BlockMask build, {capacity // 1024}k pool")
        ax.plot(*_series(records, batch, "sdpa_contiguous"), "s--", label="SDPA, contiguous K/V")
        ax.plot(*_series(records, batch, "flex_contiguous"), "^--", label="flex_attention, contiguous K/V")
        ax.plot(*_series(records, batch, "flex_contiguous_blocks"), "v:",
                label=f"flex_attention, contiguous K/V, flexpage's layout, {meta['page_size']}-token blocks")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set(xlabel="live length L (tokens)", ylabel="ms per decode step (one layer)",
               title=f"decode attention, batch {batch}")
        finish_axes(ax, sorted({r['length'] for r in records}))
    fig.suptitle(f"one attention layer, page {meta['page_size']} — {caption(meta)}", fontsize=9)
    save_figure(fig, path)


def print_summary(records: list[dict]) -> None:
    by_key = {(r["batch"], r["length"], r["config"], r["capacity"]): r["median_ms"] for r in records}
    print(f"{'B':>2} {'L':>5} {'paged4k':>8} {'paged64k':>9} {'64k/4k':>7} {'small/huge':>10} {'flex':>7} "
          f"{'paged/flex':>10} {'blocks':>7} {'paged/blocks':>12} {'sdpa':>7} {'mask64k':>8}  (ms)")
    for batch, length in sorted({(r["batch"], r["length"]) for r in records}):
        p4, p64 = by_key.get((batch, length, "paged", 4096)), by_key.get((batch, length, "paged", 65536))
        small = by_key.get((batch, length, "paged_small_pages", 65536))
        flex, sdpa = by_key[(batch, length, "flex_contiguous", None)], by_key[(batch, length, "sdpa_contiguous", None)]
        blocks = by_key[(batch, length, "flex_contiguous_blocks", None)]
        mask = by_key.get((batch, length, "mask_build", 65536))
        fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if a is not None and b else "-"  # noqa: E731
        print(f"{batch:>2} {length:>5} {fmt(p4):>8} {fmt(p64):>9} {ratio(p64, p4):>7} {ratio(small, p64):>10} {fmt(flex):>7} "
              f"{ratio(p64 or p4, flex):>10} {fmt(blocks):>7} {ratio(p64 or p4, blocks):>12} {fmt(sdpa):>7} {fmt(mask):>8}")


if __name__ == "__main__":
    main()
