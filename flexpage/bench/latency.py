"""Latency vs context length: flexpage vs stock transformers generate(), side by side in one process.

For each context length (prompt tokens), each configuration generates N new tokens (greedy, or
with ``--sample`` sampled: ``top-k`` temperature 0.8 and top-k 50, ``top-p`` temperature 0.7 and
top-p 0.9; batch 1 by default; with ``--batch B`` the B prompts have mixed lengths, left-padded
to the context length as a tokenizer pads a batch: row b holds ``length - b * length // (2B)``
tokens, from the full length down to about half of it) and we record time to first token,
per-token decode latency (median inter-token time), end-to-end latency, peak extra process memory,
KV bytes reserved vs live, and recompiles during the timed calls. The first call of each
configuration at each length is its warm-up (compiles) and is reported separately, never mixed
into the latencies.

Configurations: flexpage (wrap), flexpage_stock_linears (wrap(few_row_linears=False): the model's own
linear layers), flexpage_compiled (wrap(compile_decode=True)), flexpage_engine (each prompt a
request of an Engine, built and warmed up before timing; its host ms per step is recorded too),
flexpage_engine_eager (the same with ``compile_decode=False``: every step eager), stock
dynamic cache (sdpa), stock attn_implementation=
"flex_attention", stock static cache (eager and torch.compile'd), stock use_cache=False
(dropped at longer lengths once it exceeds --no-cache-budget seconds).

    flexpage bench latency              # llama-small, 128..2048, 64 new tokens (~15 min)
    flexpage bench latency --quick      # llama-tiny, two lengths, for CI
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm
from transformers import CompileConfig, LogitsProcessorList


import flexpage
from flexpage import zoo
from flexpage.bench.measure import (
    PeakMemory, TokenClock, add_run_arguments, caption, compiled_graphs, finish_axes, save_figure,
    machine_info, matmul_probe_ms, out_dir, write_records)

CONFIGS = ("flexpage", "flexpage_stock_linears", "flexpage_compiled", "flexpage_engine", "flexpage_engine_eager",
           "stock_dynamic_sdpa", "stock_flex_attention", "stock_static", "stock_static_compiled", "stock_no_cache")
PAPER_GROWTH = 2.0  # "Paged Attention Meets FlexAttention": ~2x latency from 128 to 2048 tokens


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def build_configs(model_name: str, max_len: int, page_size: int | None, device: str = "cpu", batch: int = 1):
    """name -> (model, extra generate kwargs, kv bytes reserved(length)), every model on ``device``;
    ``page_size`` None: each of wrap and Engine takes its own default. The Engine runs ``batch``
    requests at once (at least 8)."""
    def load(**kwargs):
        return zoo.load(model_name, **kwargs).to(device)

    pages = {} if page_size is None else {"page_size": page_size}
    stock = load()
    per_token = kv_bytes_per_token(stock.config, 4)
    paged = flexpage.wrap(load(), max_cached_tokens=max_len, **pages)
    paged_stock_linears = flexpage.wrap(load(), max_cached_tokens=max_len, few_row_linears=False, **pages)
    compiled_paged = flexpage.wrap(load(), max_cached_tokens=max_len, compile_decode=True, **pages)
    pool_bytes = sum(layer.keys.numel() * 2 * layer.keys.element_size() for layer in flexpage.paged_state(paged).cache.layers)
    engine_options = dict(max_cached_tokens=max_len, max_batch_size=max(8, batch), max_tokens_per_step=512,
                          prefix_caching=False, **pages)  # repeats recompute
    engine = flexpage.Engine(load(), **engine_options)
    eager_engine = flexpage.Engine(load(), compile_decode=False, **engine_options)
    flex = load(attn_implementation="flex_attention")
    compiled = CompileConfig(fullgraph=False, dynamic=False)
    compiled._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
    return {
        "flexpage": (paged, {}, lambda n: pool_bytes),
        "flexpage_stock_linears": (paged_stock_linears, {}, lambda n: pool_bytes),
        "flexpage_compiled": (compiled_paged, {}, lambda n: pool_bytes),
        "flexpage_engine": (engine, {}, lambda n: pool_bytes),
        "flexpage_engine_eager": (eager_engine, {}, lambda n: pool_bytes),
        "stock_dynamic_sdpa": (stock, {}, lambda n: n * per_token),
        "stock_flex_attention": (flex, {}, lambda n: n * per_token),
        "stock_static": (stock, {"cache_implementation": "static", "disable_compile": True}, lambda n: n * per_token),
        "stock_static_compiled": (stock, {"cache_implementation": "static", "compile_config": compiled},
                                  lambda n: n * per_token),
        "stock_no_cache": (stock, {"use_cache": False}, lambda n: 0),
    }


def batch_prompts(length: int, batch: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[batch, length]`` and their padding mask: row ``b`` holds
    ``length - b * length // (2 * batch)`` random tokens after its left padding (id 0)."""
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(length))
    real = torch.arange(length) >= torch.tensor([b * length // (2 * batch) for b in range(batch)])[:, None]
    return (ids * real).to(device), real.long().to(device)


SAMPLING = {  # --sample: what every configuration draws with
    "top-k": {"do_sample": True, "temperature": 0.8, "top_k": 50},
    "top-p": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
}


def run_once(model, ids, mask, new_tokens, extra, sampling):
    clock = TokenClock()
    gc.collect()
    graphs = compiled_graphs()
    host_ms = {}
    with PeakMemory(ids.device) as memory:
        start = time.perf_counter()
        if isinstance(model, flexpage.Engine):  # each prompt its own request, served together
            model.reset_stats()
            counts = [0] * ids.shape[0]
            prompts = [row[real.bool()].tolist() for row, real in zip(ids, mask)]  # no padding: one request each
            for index, _ in model.stream(prompts, max_new_tokens=new_tokens, eos_token_id=[], **sampling):
                if index == 0:  # one timestamp per step, as generate()'s logits processor gives
                    clock.times.append(time.perf_counter())
                counts[index] += 1
            out_tokens = min(counts)
            host_ms = {"host_ms_per_step": model.stats().host_ms_per_step}
        else:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0, **sampling,
                                 logits_processor=LogitsProcessorList([clock]), **extra)
            out_tokens = out.shape[1] - ids.shape[1]
        end = time.perf_counter()
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return {
        "ttft_ms": (clock.times[0] - start) * 1e3,
        "decode_ms_per_token": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "e2e_ms": (end - start) * 1e3,
        "peak_mem_mb": memory.peak_mb,
        "recompiles": compiled_graphs() - graphs,
        "tokens": out_tokens,
        **host_ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--page-size", type=int, default=None,
                        help="tokens per page (default: wrap's and the Engine's own defaults)")
    parser.add_argument("--device", default="cpu", help="where the models run (cpu, cuda, ...)")
    parser.add_argument("--no-cache-budget", type=float, default=20.0,
                        help="seconds: stock_no_cache stops at the first length whose call takes longer")
    parser.add_argument("--probe-tolerance", type=float, default=1.5)
    parser.add_argument("--sample", nargs="?", const="top-k", choices=sorted(SAMPLING),
                        help=f"every configuration samples ({SAMPLING}) instead of decoding greedily")
    add_run_arguments(parser, "llama-tiny, lengths 64 and 256, 8 new tokens, 2 repeats", "latency",
                      default="results/latency")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.lengths, args.new_tokens, args.repeats = [64, 256], 8, 2
    sampling = SAMPLING[args.sample] if args.sample else {"do_sample": False}

    largest_page = args.page_size or flexpage.core.policy.CPU_POLICY.page_size
    max_len = -(-(max(args.lengths) + args.new_tokens) // largest_page) * largest_page  # whole pages per row
    built = build_configs(args.model, args.batch * max_len, args.page_size, args.device, args.batch)
    config = built["stock_dynamic_sdpa"][0].config  # built whichever configurations are timed
    configs = {k: v for k, v in built.items() if k in args.configs}
    vocab, per_token = config.vocab_size, kv_bytes_per_token(config, 4)
    records, dropped = [], {}  # configuration -> the length where it went over budget
    progress = tqdm(total=len(args.lengths) * len(configs) * (args.repeats + 1), desc="latency")
    for length in args.lengths:
        ids, mask = batch_prompts(length, args.batch, vocab, args.device)
        samples: dict[str, list[dict]] = {name: [] for name in configs}
        warmup: dict[str, float] = {}
        for name, (model, extra, _) in configs.items():  # warm-up: compiles, first-touch allocations
            if name not in dropped:
                start = time.perf_counter()
                run_once(model, ids, mask, args.new_tokens, extra, sampling)
                warmup[name] = time.perf_counter() - start
                if name == "stock_no_cache" and warmup[name] > args.no_cache_budget:
                    dropped[name] = length
            progress.update(1)
        best_probe = matmul_probe_ms()
        for _ in range(args.repeats):  # interleaved: every configuration once per round
            for name, (model, extra, _) in configs.items():
                if name in dropped and not samples[name]:
                    progress.update(1)
                    continue
                for _attempt in range(3):
                    before = matmul_probe_ms()
                    result = run_once(model, ids, mask, args.new_tokens, extra, sampling)
                    after = matmul_probe_ms()
                    best_probe = min(best_probe, before, after)
                    if max(before, after) <= args.probe_tolerance * best_probe:
                        break
                samples[name].append(result)
                progress.update(1)
        for name, (model, extra, reserved) in configs.items():
            runs = samples[name]
            record = {"config": name, "length": length, "batch": args.batch, "prompt_tokens": int(mask.sum()),
                      "new_tokens": args.new_tokens, "warmup_s": round(warmup.get(name, float("nan")), 3)}
            if not runs:
                record["note"] = (f"dropped: its call at {dropped[name]} tokens took over {args.no_cache_budget}s, "
                                  "so longer lengths are not timed")
                records.append(record)
                continue
            for key in ("ttft_ms", "decode_ms_per_token", "e2e_ms", "peak_mem_mb", "host_ms_per_step"):
                if key in runs[0]:  # host work per step: the Engine's alone
                    record[key] = round(statistics.median(r[key] for r in runs), 3)
            record["recompiles"] = sum(r["recompiles"] for r in runs)
            live = int(mask.sum()) + args.batch * (args.new_tokens - 1)
            record["kv_live_bytes"] = live * per_token if name != "stock_no_cache" else 0
            record["kv_reserved_bytes"] = reserved(live)
            records.append(record)
    progress.close()
    meta = {"machine": machine_info(), "model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "page_size": args.page_size or "defaults", "dtype": "float32", "device": args.device,
            "dropped": dropped, "sampling": sampling, "command": " ".join(sys.argv)}
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, records, meta)
    plot(records, meta, stem)
    print_summary(records)
    print(f"wrote {stem}.csv, {stem}.json, {stem}_*.png")


def _series(records, config, key):
    rows = sorted((r for r in records if r["config"] == config and key in r), key=lambda r: r["length"])
    return [r["length"] for r in rows], [r[key] for r in rows]


def plot(records: list[dict], meta: dict, stem: str) -> None:
    """end-to-end latency, per-token decode latency and peak memory vs length; PNGs next to ``stem``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in records))
    lengths = sorted({r["length"] for r in records})
    for key, label in (("e2e_ms", "end-to-end latency (ms)"), ("decode_ms_per_token", "decode latency per token (ms)"),
                       ("peak_mem_mb", "peak extra memory during the call (MB)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for config in configs:
            xs, ys = _series(records, config, key)
            if xs:
                ours = config.startswith("flexpage")
                ax.plot(xs, ys, "o-" if ours else "s--", label=config, linewidth=2.5 if ours else 1.2)
        if key != "peak_mem_mb":
            xs, ys = _series(records, "flexpage", key)
            if xs:  # the paper's claim: ~2x from the shortest to 2048 tokens, linear in between
                ref = [ys[0] * (1 + (PAPER_GROWTH - 1) * (x - xs[0]) / max(1, 2048 - xs[0])) for x in xs]
                ax.plot(xs, ref, ":", color="gray", label="paper: 2x from 128 to 2048")
        ax.set_xscale("log", base=2)
        values = [r[key] for r in records if key in r and r[key] > 0]
        if key != "peak_mem_mb" and values and max(values) > 10 * min(values):
            ax.set_yscale("log")  # use_cache=False grows so fast that a linear axis flattens the rest
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.minorticks_off()
        ax.set(xlabel="context length (tokens)", ylabel=label)
        ax.set_title(f"{label}, batch {meta['batch']}\n{caption(meta)}", fontsize=9)
        finish_axes(ax, lengths)
        save_figure(fig, f"{stem}_{key}.png")


def print_summary(records: list[dict]) -> None:
    by = {(r["config"], r["length"]): r for r in records}
    lengths = sorted({r["length"] for r in records})
    configs = list(dict.fromkeys(r["config"] for r in records))
    for ours in [c for c in configs if c.startswith("flexpage")]:
        print(f"decode ms/token, and {ours} / each configuration:")
        for length in lengths:
            mine = by.get((ours, length), {}).get("decode_ms_per_token")
            cells = []
            for config in configs:
                value = by.get((config, length), {}).get("decode_ms_per_token")
                ratio = f" ({mine / value:.2f}x)" if mine and value and config != ours else ""
                cells.append(f"{config}={value if value is not None else '-'}{ratio}")
            host = by.get((ours, length), {}).get("host_ms_per_step")
            print(f"  L={length}: " + ", ".join(cells) + (f"; host {host} ms per step" if host is not None else ""))
        xs, ys = _series(records, ours, "decode_ms_per_token")
        if len(ys) > 1:
            print(f"{ours} decode growth {xs[-1]}/{xs[0]}: {ys[-1] / ys[0]:.2f}x; recompiles after warm-up: "
                  f"{sum(by[(ours, x)]['recompiles'] for x in xs)}")


if __name__ == "__main__":
    main()
