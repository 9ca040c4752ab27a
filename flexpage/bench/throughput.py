"""Throughput on many requests of mixed lengths: flexpage Engine vs stock transformers, one process.

A seeded workload (default: 64 requests, prompts 64-2048 tokens, outputs 16-256 tokens, no
early stop) is served by each configuration in turn:

* flexpage Engine: continuous batching, ragged steps, one paged pool;
* stock generate() on padded static batches (batch sizes 1, 8, 16; batch 1 is the
  sequential loop): each batch is left-padded and runs until its longest output is done;
* transformers' own continuous batching (init_continuous_batching / add_request, the API
  behind generate_batch), with per-request output lengths.

Reported per configuration: generated tokens/s, requests/s, time to first token p50/p99
(from the run's start: every request arrives at once), KV utilisation (live / reserved
slots, averaged over steps), peak pages, preemptions. The Engine runs the workload twice
and reports both: the engine compiles every step shape when it is built (``warmup_s``), so
its first run is served without compiling (``flexpage_engine_first_run``). A second engine
built with ``few_row_linears=False`` (``flexpage_engine_stock_linears``) runs the model's own
linear layers, so the ratio shows what the paged batching gives alone; a third with
``pack_weights=False`` (``flexpage_engine_unpacked``, after one unrecorded run that decides its
kernels) keeps one copy of the weights, where the default engine reads packed copies through
oneDNN when they fit in memory (``packed_weight_mb`` says whether it did). Stock configurations get a short warm-up call. A small matmul probe runs between
cells; a cell whose probe after it is ``--probe-tolerance`` x slower than the best probe seen
ran during one of these VMs' slow spells and is run again (twice at most; ``remeasured``).
``--rounds N`` runs every configuration N times, interleaved round by round, and reports each
one's median run (``tokens_per_s_rounds`` lists them all): these VMs' speed drifts within minutes.

    flexpage bench throughput            # llama-small, 64 requests (~15 min)
    flexpage bench throughput --quick    # llama-tiny, 8 short requests, for CI
    flexpage bench throughput --requests 24 --prompt-range 8 300 --output-range 4 40 \
        --name throughput_short                   # the short-request workload
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm
from transformers import GenerationConfig, LogitsProcessorList


import flexpage
from flexpage import zoo
from flexpage.bench.measure import (
    TokenClock, add_run_arguments, caption, engine_generate, finish_axes, save_figure, machine_info, matmul_probe_ms,
    out_dir, write_records)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(n):
        length = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (length,), generator=g).tolist())
        outputs.append(int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=g)))
    return prompts, outputs


def fixed_length_model(name: str, device: str = "cpu"):
    """A model that never stops early (no EOS), so every configuration generates the same tokens."""
    model = zoo.load(name).to(device)
    model.generation_config.eos_token_id = None
    return model


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summary(name: str, seconds: float, outputs: list[int], ttft: list[float], **extra) -> dict:
    return {"config": name, "seconds": round(seconds, 3), "requests": len(outputs),
            "generated_tokens": sum(outputs), "tokens_per_s": round(sum(outputs) / seconds, 2),
            "requests_per_s": round(len(outputs) / seconds, 4),
            "ttft_mean_s": round(statistics.mean(ttft), 3), "ttft_p50_s": round(percentile(ttft, 50), 3),
            "ttft_p99_s": round(percentile(ttft, 99), 3), **extra}


def run_engine(engine: flexpage.Engine, prompts, outputs, name: str = "flexpage_engine") -> tuple[dict, list]:
    engine.cache.page_table.clear_prefix_cache()  # no run may reuse an earlier run's pages
    engine.reset_stats()
    start = time.perf_counter()
    results, ttft = engine_generate(engine, prompts, outputs)
    seconds = time.perf_counter() - start
    assert [len(r) for r in results] == outputs
    stats = engine.stats()
    trace = [{"t": round(h.time - start, 4), "kv_utilisation": round(h.kv_utilisation, 4), "pages_used": h.pages_used,
              "decode_tokens": h.decode_tokens, "prefill_tokens": h.prefill_tokens} for h in engine.history]
    record = summary(name, seconds, outputs, ttft, batch_size=engine.scheduler.max_batch_size,
                     kv_utilisation=round(stats.kv_utilisation, 4), peak_pages=stats.peak_pages_used,
                     pages_total=engine.cache.page_table.num_pages, preemptions=stats.preemptions,
                     prefix_hit_tokens=stats.prefix_hit_tokens,
                     steps=stats.steps, compiled_shapes=stats.compiled_shapes,
                     host_ms_per_step=round(stats.host_ms_per_step, 3),
                     packed_weight_mb=round(stats.packed_weight_bytes / 2**20, 1))
    return record, trace


def run_padded(model, prompts, outputs, batch_size: int) -> dict:
    """Stock generate() over fixed batches in arrival order, left-padded; each batch runs to its longest output."""
    start = time.perf_counter()
    ttft, live_sum, steps = [], 0.0, 0
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"stock b={batch_size}", leave=False):
        batch, news = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        clock = TokenClock()
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max(news), min_new_tokens=max(news), do_sample=False,
                       pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        ttft += [clock.times[0] - start] * len(batch)
        for t in range(1, max(news) + 1):  # the dense cache holds batch x (width + t); live: the real tokens
            live_sum += sum(len(p) + min(t, n) for p, n in zip(batch, news)) / (len(batch) * (width + t))
            steps += 1
    return summary(f"stock_padded_b{batch_size}", time.perf_counter() - start, outputs, ttft, batch_size=batch_size,
                   kv_utilisation=round(live_sum / steps, 4))


def run_continuous(model, prompts, outputs) -> dict:
    """transformers' continuous batching with per-request output lengths."""
    config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=None, pad_token_id=0)
    done = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        start = time.perf_counter()  # after its warm-up
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, outputs)]
        with tqdm(total=len(ids), desc="stock continuous", leave=False) as bar:
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped")
    seconds = time.perf_counter() - start
    errors = [r.error for r in done.values() if r.error]
    if errors:
        raise RuntimeError(errors[0])
    ttft = [r.timestamps[0] - start for r in done.values() if r.timestamps]
    got = [len(done[i].generated_tokens) for i in ids]
    return summary("stock_continuous_batching", seconds, got, ttft, batch_size="auto")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[64, 2048])
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16], help="stock padded batches")
    parser.add_argument("--engine-batch", type=int, default=32, help="Engine max_batch_size")
    parser.add_argument("--max-tokens-per-step", type=int, default=512)
    parser.add_argument("--max-cached-tokens", type=int, default=65536)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="where the models run (cpu, cuda, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, interleaved; report each one's median run")
    parser.add_argument("--probe-tolerance", type=float, default=1.5,
                        help="re-run a cell whose matmul probe after it is this much slower than the best probe")
    add_run_arguments(parser, "llama-tiny, 8 requests of 16-200 tokens, 4-24 new", "throughput",
                      default="results/throughput")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.requests, args.prompt_range, args.output_range = 8, [16, 200], [4, 24]
        args.batch_sizes, args.engine_batch, args.max_tokens_per_step, args.max_cached_tokens = [1, 4], 8, 128, 4096

    stock = fixed_length_model(args.model, args.device)
    prompts, outputs = make_workload(args.requests, args.prompt_range, args.output_range, stock.config.vocab_size,
                                     args.seed)

    def build_engine(**options) -> flexpage.Engine:
        return flexpage.Engine(fixed_length_model(args.model, args.device), page_size=args.page_size,
                               max_cached_tokens=args.max_cached_tokens, max_batch_size=args.engine_batch,
                               max_tokens_per_step=args.max_tokens_per_step, **options)

    engine = build_engine()
    warmup = engine.stats().warmup_seconds  # every step shape, compiled when the engine was built
    # the same engine with the model's own linear layers: how much of the ratio few-row linears give
    engine_stock_linears = build_engine(few_row_linears=False)
    engine_unpacked = build_engine(pack_weights=False)
    stock.generate(torch.tensor([prompts[0][:16]], device=stock.device), max_new_tokens=2, pad_token_id=0)  # warm-up
    first_run, _ = run_engine(engine, prompts, outputs, "flexpage_engine_first_run")
    run_engine(engine_unpacked, prompts, outputs)  # its kernels decided (unpacked weights' are timed apart)

    records, errors = [], {}
    probes = [matmul_probe_ms()]

    def measured(cell):
        """Run a cell; run it again (twice at most) when the probe after it shows a slow spell."""
        for attempt in range(3):
            result = cell()
            probes.append(matmul_probe_ms())
            if probes[-1] <= args.probe_tolerance * min(probes) or attempt == 2:
                break
        result[0].update(probe_after_ms=round(probes[-1], 3), remeasured=attempt)
        return result

    cells = {  # name -> a run returning (record, KV trace or None)
        "flexpage_engine": lambda: run_engine(engine, prompts, outputs),
        "flexpage_engine_stock_linears": lambda: run_engine(engine_stock_linears, prompts, outputs,
                                                            "flexpage_engine_stock_linears"),
        "flexpage_engine_unpacked": lambda: run_engine(engine_unpacked, prompts, outputs, "flexpage_engine_unpacked"),
        **{f"stock_padded_b{b}": lambda b=b: (run_padded(stock, prompts, outputs, b), None) for b in args.batch_sizes},
        "stock_continuous_batching": lambda: (run_continuous(stock, prompts, outputs), None),
    }
    runs: dict[str, list[tuple[dict, list | None]]] = {name: [] for name in cells}
    for _ in tqdm(range(args.rounds), desc="rounds", disable=args.rounds == 1):  # configurations interleaved
        for name, cell in cells.items():
            if name in errors:
                continue
            try:
                runs[name].append(measured(cell))
            except Exception as error:  # report, don't hide: the row says why it is missing
                errors[name] = f"{type(error).__name__}: {error}"
                print(f"{name} failed:", errors[name])
    for name, results in runs.items():
        if not results:
            continue
        record, run_trace = sorted(results, key=lambda r: r[0]["tokens_per_s"])[len(results) // 2]  # the median run
        record["tokens_per_s_rounds"] = [r[0]["tokens_per_s"] for r in results]
        records.append(record)
        if name == "flexpage_engine":
            trace = run_trace
            record["warmup_s"] = round(warmup, 2)
            records.append(first_run)

    best_padded = max((r for r in records if r["config"].startswith("stock_padded")), key=lambda r: r["tokens_per_s"])
    for r in records:
        r["speedup_vs_best_padded"] = round(r["tokens_per_s"] / best_padded["tokens_per_s"], 3)
    meta = {"machine": machine_info(), "model": args.model, "dtype": "float32", "device": args.device,
            "requests": args.requests, "rounds": args.rounds,
            "prompt_range": args.prompt_range, "output_range": args.output_range, "seed": args.seed,
            "engine": {"max_batch_size": args.engine_batch, "max_tokens_per_step": args.max_tokens_per_step,
                       "max_cached_tokens": args.max_cached_tokens, "page_size": args.page_size},
            "prompt_tokens": sum(map(len, prompts)), "matmul_probe_ms": [round(p, 3) for p in probes],
            "errors": errors, "command": " ".join(sys.argv)}
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, records, meta)
    write_records(stem + "_kv_trace", trace, meta)
    plot(records, trace, meta, stem)
    for r in records:
        print(f"{r['config']:>28}: {r['tokens_per_s']:8.1f} tok/s  {r['requests_per_s']:.3f} req/s  "
              f"TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s  KV util {r.get('kv_utilisation', '-')}  "
              f"x{r['speedup_vs_best_padded']} vs best padded")
    print(f"probe (ms) before/after cells: {meta['matmul_probe_ms']}  median {statistics.median(probes):.3f}")
    print(f"wrote {stem}.csv, {stem}.json, {stem}_kv_trace.csv, {stem}_*.png")


def plot(records: list[dict], trace: list[dict], meta: dict, stem: str) -> None:
    """Throughput vs batch size and the Engine's pool over time, as ``<stem>_vs_batch.png`` and
    ``<stem>_kv_utilisation.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    padded = sorted((r for r in records if r["config"].startswith("stock_padded")), key=lambda r: r["batch_size"])
    ax.plot([r["batch_size"] for r in padded], [r["tokens_per_s"] for r in padded], "s--", label="stock generate(), padded batches")
    for r in records:
        if r["config"] == "flexpage_engine":
            ax.plot([r["batch_size"]], [r["tokens_per_s"]], "o", markersize=10, label=f"flexpage Engine (max batch {r['batch_size']})")
        elif r["config"] == "stock_continuous_batching":
            ax.axhline(r["tokens_per_s"], color="gray", linestyle=":", label="transformers continuous batching")
    ax.set(xlabel="batch size", ylabel="generated tokens / s")
    ax.set_title(f"throughput, {meta['requests']} requests\n{caption(meta)}", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    sizes = sorted({r["batch_size"] for r in records if isinstance(r.get("batch_size"), int)})
    finish_axes(ax, sizes)
    save_figure(fig, f"{stem}_vs_batch.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([t["t"] for t in trace], [t["kv_utilisation"] for t in trace], label="KV utilisation (live / reserved)")
    ax2 = ax.twinx()
    ax2.plot([t["t"] for t in trace], [t["pages_used"] for t in trace], color="tab:orange", alpha=0.6, label="pages used")
    ax.set(xlabel="seconds", ylabel="KV utilisation", ylim=(0, 1.05))
    ax.set_title(f"flexpage Engine: the pool over time\n{caption(meta)}", fontsize=9)
    ax2.set_ylabel("pages used")
    fig.legend(loc="lower right", fontsize=8)
    save_figure(fig, f"{stem}_kv_utilisation.png")


if __name__ == "__main__":
    main()
