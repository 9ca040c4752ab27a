"""Prefix sharing: many requests that start with the same tokens, with and without prefix caching.

Two seeded scenarios (greedy, no early stop):

* system_prompt: 32 requests = one shared 1024-token system prompt + a distinct 64-token question;
* document_qa: one 1024-token document followed by 16 distinct 64-token questions.

Each is served by the flexpage Engine with prefix caching (the default) and without it, by
stock generate() on padded batches of 8, and by transformers' own continuous batching.
Reported: peak KV pages (tokens for the stock paths), mean / p50 time to first token,
generated tokens/s, end-to-end seconds. Engines are warmed up (compiles) on the same
scenario first, and the prefix cache is emptied before the timed run.

    flexpage bench prefix            # llama-small (~10 min)
    flexpage bench prefix --quick    # llama-tiny, short prompts, for CI
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


import flexpage
from flexpage import zoo
from flexpage.bench.measure import (
    add_run_arguments, caption, engine_generate, save_figure, machine_info, matmul_probe_ms, out_dir, write_records)
from flexpage.bench.throughput import fixed_length_model, percentile, run_continuous, run_padded


def scenario(prefix_len: int, requests: int, question_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (question_len,), generator=g).tolist() for _ in range(requests)]


def run_engine(engine: flexpage.Engine, name: str, prompts, new_tokens: int) -> dict:
    engine.generate(prompts, max_new_tokens=new_tokens)  # warm-up: compiles this scenario's step shapes
    engine.cache.page_table.clear_prefix_cache()
    engine.reset_stats()
    start = time.perf_counter()
    outputs, ttft = engine_generate(engine, prompts, new_tokens)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    page = engine.cache.page_size
    return {"config": name, "seconds": round(seconds, 3), "tokens_per_s": round(sum(map(len, outputs)) / seconds, 2),
            "ttft_mean_s": round(statistics.mean(ttft), 3), "ttft_p50_s": round(percentile(ttft, 50), 3),
            "peak_pages": stats.peak_pages_used, "peak_kv_tokens": stats.peak_pages_used * page,
            "prompt_tokens_computed": stats.prompt_tokens_computed, "prefix_hit_tokens": stats.prefix_hit_tokens,
            "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, nargs=2, default=[32, 16], help="system_prompt, document_qa")
    parser.add_argument("--engine-batch", type=int, default=32)
    parser.add_argument("--max-cached-tokens", type=int, default=65536)
    parser.add_argument("--stock-batch", type=int, default=8)
    add_run_arguments(parser, "llama-tiny, 128-token prefix, 6 and 4 requests", default="results/prefix")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.prefix_len, args.question_len, args.new_tokens = 128, 16, 8
        args.requests, args.engine_batch, args.max_cached_tokens, args.stock_batch = [6, 4], 8, 4096, 4

    stock = fixed_length_model(args.model)
    engines = {
        "flexpage_prefix_caching": flexpage.Engine(fixed_length_model(args.model), max_cached_tokens=args.max_cached_tokens,
                                                   max_batch_size=args.engine_batch),
        "flexpage_no_prefix_caching": flexpage.Engine(fixed_length_model(args.model),
                                                      max_cached_tokens=args.max_cached_tokens,
                                                      max_batch_size=args.engine_batch, prefix_caching=False),
    }
    records, errors, probes = [], {}, [matmul_probe_ms()]
    for (name, requests, seed) in (("system_prompt", args.requests[0], 1), ("document_qa", args.requests[1], 2)):
        prompts = scenario(args.prefix_len, requests, args.question_len, stock.config.vocab_size, seed)
        news = [args.new_tokens] * requests
        rows = [run_engine(engine, config, prompts, args.new_tokens) for config, engine in engines.items()]
        same = rows[0].pop("outputs") == rows[1].pop("outputs")
        probes.append(matmul_probe_ms())
        padded = run_padded(stock, prompts, news, args.stock_batch)
        padded["peak_kv_tokens"] = min(args.stock_batch, requests) * (args.prefix_len + args.question_len + args.new_tokens)
        rows.append(padded)
        try:
            rows.append(run_continuous(stock, prompts, news))
        except Exception as error:  # report, don't hide
            errors[name] = f"{type(error).__name__}: {error}"
        probes.append(matmul_probe_ms())
        for row in rows:
            row.update(scenario=name, requests=requests, outputs_equal_without_caching=same)
        base, cached = rows[1], rows[0]
        cached["pages_vs_no_caching"] = round(cached["peak_pages"] / base["peak_pages"], 3)
        cached["ttft_vs_no_caching"] = round(cached["ttft_mean_s"] / base["ttft_mean_s"], 3)
        records += rows
    meta = {"machine": machine_info(), "model": args.model, "prefix_len": args.prefix_len,
            "question_len": args.question_len, "new_tokens": args.new_tokens, "requests": args.requests,
            "engine_batch": args.engine_batch, "stock_batch": args.stock_batch,
            "matmul_probe_ms": [round(p, 3) for p in probes], "errors": errors, "command": " ".join(sys.argv)}
    stem = os.path.join(out_dir(args), "prefix")
    write_records(stem, records, meta)
    plot(records, meta, stem)
    for r in records:
        print(f"{r['scenario']:>13} {r['config']:>27}: {r['tokens_per_s']:8.1f} tok/s  TTFT mean {r['ttft_mean_s']:.2f}s  "
              f"peak KV tokens {r.get('peak_kv_tokens', '-')}  {r.get('pages_vs_no_caching', '')} "
              f"{r.get('ttft_vs_no_caching', '')}")
    print(f"wrote {stem}.csv, {stem}.json, {stem}.png")


def plot(records: list[dict], meta: dict, stem: str) -> None:
    """Peak KV tokens, mean TTFT and throughput per scenario and configuration, as ``<stem>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in records))
    configs = list(dict.fromkeys(r["config"] for r in records))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label in zip(axes, ("peak_kv_tokens", "ttft_mean_s", "tokens_per_s"),
                              ("peak KV tokens held", "mean time to first token (s)", "generated tokens / s")):
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            values = [next((r.get(key, 0) for r in records if r["scenario"] == s and r["config"] == config), 0)
                      for s in scenarios]
            ax.bar([x + i * width for x in range(len(scenarios))], values, width, label=config)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(scenarios))], scenarios)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"shared prefixes, {meta['new_tokens']} new tokens per request — {caption(meta)}", fontsize=9)
    save_figure(fig, f"{stem}.png")


if __name__ == "__main__":
    main()
