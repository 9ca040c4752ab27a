"""Long contexts: batch-1 decode to 64k tokens over pages in the model's dtype, int8 and float8,
beside stock's dynamic cache and the step's memory roofline; and how faithful quantised pages are.

Decode at context L: the sequence's first L tokens of K/V are written straight into the cache
(random values of unit scale: a decode step's work and bytes do not depend on them, and a real
prefill of 64k tokens takes this CPU many minutes), then ``--steps`` one-token forwards run
through the model, each feeding the token the last one chose; ms per token is the median step.
The roofline is the time of one bandwidth-bound reduction over the step's bytes in the same
round: the weights and the K/V the sequence holds, as the format stores them. The ``window``
configuration is a model whose every layer attends a sliding window (``--window-model``) over
model-dtype pages: after its first step its row holds only the window's pages, and the cell
records the fraction of K/V bytes it holds against keeping every page. The ``groups`` configuration
is a model whose layers alternate a sliding window and global attention (``--groups-model``,
Gemma 2-shaped): its windowed layers' pages are held by the row's window row, which keeps only
the window's (``PagedKVCache``), the global layers' by the row. TTFT is a real prefill of
L tokens, up to ``--prefill-max``. The paged models decode through ``wrap``'s compiled static step
(``compile_decode=True``; ``--eager``: the eager forward). Stock runs the same steps over its
dynamic cache. Every length
is measured once per round, configurations in turn; each cell reports its median round.

Faithfulness, for each quantised format: the attention outputs of every layer during a prefill of
L tokens against those over model-dtype pages (max and mean absolute error, and the mean relative
to the outputs' mean magnitude), and the greedy tokens of 256-token generations from several zoo
models against model-dtype pages (the fraction of positions that agree; a divergence makes the
rest of a generation disagree), and teacher-forced: at each of those positions, after the
model-dtype pages' tokens, whether the format picks the same next token.

    flexpage bench long                     # llama-small, 128..65536, model dtype / int8 / fp8, stock,
                                            # mistral-small, gemma2-small
    flexpage bench long --parts decode      # the decode cells only (--parts faithfulness: the rest)
    flexpage bench long --quick             # llama-tiny and mistral-tiny, two lengths, a few steps (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

import flexpage
from flexpage import zoo
from flexpage.bench.measure import (add_run_arguments, caption, finish_axes, machine_info, out_dir, save_figure,
                                    save_run, write_records)
from flexpage.bench.roofline import read_ms, weight_tensors
from flexpage.hf import cache_argument

FORMATS = ("auto", "int8", "fp8")  # ``kv_dtype``: the model's dtype, then the quantised formats
FILL_CHUNK = 4096  # tokens of K/V written at a time when filling a context


def kv_shape(model: PreTrainedModel) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of the model's attention layers."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim


def random_kv(model: PreTrainedModel, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, kv_heads, tokens, head_dim]`` of unit scale, in the model's dtype."""
    heads, dim = kv_shape(model)
    return tuple(torch.randn(1, heads, tokens, dim, generator=generator).to(model.dtype) for _ in range(2))


def fill_paged(model: PreTrainedModel, context: int, seed: int) -> flexpage.PagedKVCache:
    """The wrapped model's cache holding one sequence of ``context`` tokens of random K/V, as a
    batch of one that the model's next forward continues."""
    cache = flexpage.paged_state(model).cache
    cache.reset()
    row = cache.add_sequence()
    cache.reserve([row], [context])
    pt = cache.page_table
    slots = {held: pt.slots_of(pt.seq_pages[held])[None, :context] for held in pt.rows_of(row)}
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, context, FILL_CHUNK):
        end = min(context, start + FILL_CHUNK)
        for i, layer in enumerate(cache.layers):
            layer.write(slots[cache.layer_row(i, row)][:, start:end], *random_kv(model, end - start, generator))
    cache.batch_rows, cache.seen_tokens = [row], context
    return cache


def held_kv(cache: flexpage.PagedKVCache, row: int) -> list[torch.Tensor]:
    """The K/V of every layer that ``row`` holds now: from its first kept page (a window's) to its end,
    a windowed layer's in the row's window row where the cache keeps one."""
    pt, kv = cache.page_table, []
    for i, layer in enumerate(cache.layers):
        held = cache.layer_row(i, row)
        start = pt.first_held[held] * cache.page_size
        slots = pt.slots_of(pt.seq_pages[held][pt.first_held[held] :])[: pt.seq_lens[held] - start]
        kv += [pool[:, :, slots] for pool in (layer.keys, layer.values)]
    return kv


def fill_stock(model: PreTrainedModel, context: int, seed: int) -> DynamicCache:
    """A dynamic cache holding ``context`` tokens of random K/V in every layer."""
    cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(seed)
    for layer in range(model.config.num_hidden_layers):
        cache.update(*random_kv(model, context, generator), layer)
    return cache


def decode_ms(model: PreTrainedModel, cache, steps: int, seed: int) -> list[float]:
    """Each of ``steps`` one-token forwards over ``cache`` (greedy: each feeds the last one's argmax)."""
    token = torch.randint(3, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed))
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            start = time.perf_counter()
            logits = model(input_ids=token, **{cache_argument(model): cache}).logits
            token = logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def ttft_ms(model: PreTrainedModel, context: int, seed: int) -> float:
    """A real prefill of ``context`` random tokens through the wrapped model: its first token's time."""
    flexpage.paged_state(model).cache.reset()
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1, **{cache_argument(model): flexpage.paged_state(model).cache})
        return (time.perf_counter() - start) * 1e3


def attention_outputs(model: PreTrainedModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every decoder layer's attention output (before its output projection's residual add) in a prefill of ``ids``."""
    outputs, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0].float())))
    try:
        flexpage.paged_state(model).cache.reset()
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1, **{cache_argument(model): flexpage.paged_state(model).cache})
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def next_tokens(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """The wrapped model's greedy choice after each of ``tokens``' prefixes from position 128 on, in one
    forward over them all (teacher forcing: every position sees the same prefix whatever it chose)."""
    cache = flexpage.paged_state(model).cache
    cache.reset()
    with torch.inference_mode():
        logits = model(input_ids=tokens[None, :-1], **{cache_argument(model): cache}).logits
    cache.reset()
    return logits[0, 127:].argmax(-1)


def faithfulness(models: list[str], formats: list[str], lengths: list[int], new_tokens: int, prompts: int
                 ) -> tuple[list[dict], list[dict]]:
    """Attention-output errors per layer and length (the first model) and greedy agreement per model
    and prompt, of each quantised format against pages in the model's dtype: over free-running generations
(a first difference makes the rest differ) and teacher-forced (each position after the model-dtype
pages' tokens, ``next_tokens``)."""
    errors, agreement = [], []
    quantised = [f for f in formats if f != "auto"]
    for name in tqdm(models, desc="faithfulness", unit="model"):
        wrapped = {f: flexpage.wrap(zoo.load(name), kv_dtype=None if f == "auto" else f,
                                    max_cached_tokens=max([*lengths, 128 + new_tokens]) + 64, max_batch_size=1)
                   for f in ("auto", *quantised)}
        vocab = wrapped["auto"].config.vocab_size
        if name == models[0]:
            for length in lengths:
                ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
                exact = attention_outputs(wrapped["auto"], ids)
                for f in quantised:
                    for layer, (ref, out) in enumerate(zip(exact, attention_outputs(wrapped[f], ids))):
                        error = (out - ref).abs()
                        errors.append({"model": name, "format": f, "length": length, "layer": layer,
                                       "max_abs": float(error.max()), "mean_abs": float(error.mean()),
                                       "mean_rel": float(error.mean() / ref.abs().mean())})
        for p in range(prompts):
            ids = torch.randint(3, vocab, (1, 128), generator=torch.Generator().manual_seed(1000 + p))
            runs = {f: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)[0, 128:] for f, model in wrapped.items()}
            forced = {f: next_tokens(model, torch.cat([ids[0], runs["auto"]])) for f, model in wrapped.items()}
            for f in quantised:
                same = runs[f] == runs["auto"]
                first = int((~same).nonzero()[0, 0]) if not bool(same.all()) else new_tokens
                agreement.append({"model": name, "format": f, "prompt": p, "agree": round(float(same.float().mean()), 4),
                                  "first_difference": first,
                                  "forced_agree": round(float((forced[f] == forced["auto"]).float().mean()), 4)})
        del wrapped
    return errors, agreement


def plot(summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    lengths = sorted({r["length"] for r in summary})
    configs = list(dict.fromkeys(r["config"] for r in summary))
    for config in configs:
        rows = sorted((r for r in summary if r["config"] == config), key=lambda r: r["length"])
        line = axes[0].plot([r["length"] for r in rows], [r["ms"] for r in rows], marker="o", label=config)[0]
        axes[0].plot([r["length"] for r in rows], [r["roofline_ms"] for r in rows], ls="--", color=line.get_color(),
                     lw=0.8)
        axes[1].plot([r["length"] for r in rows], [r["kv_mb"] for r in rows], marker="o", label=config)
        axes[2].plot([r["length"] for r in rows], [r["x_roofline"] for r in rows], marker="o", label=config)
    axes[0].set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms per token (median)",
                title="batch-1 decode (dashed: each one's roofline)")
    axes[1].set(xscale="log", yscale="log", xlabel="context tokens", ylabel="MB",
                title="K/V the sequence holds (all layers)")
    axes[2].axhline(1.0, color="black", lw=0.8)
    axes[2].set(xscale="log", xlabel="context tokens", ylabel="decode time / roofline", title="distance to the roofline")
    for ax in axes:
        ax.minorticks_off()
        finish_axes(ax, lengths, lambda n: f"{n // 1024}k" if n >= 1024 else str(n))
    fig.suptitle(caption(meta), fontsize=8)
    save_figure(fig, path)


def decode_cells(args: argparse.Namespace) -> None:
    """Batch-1 decode at each length for each configuration, in rounds; writes ``<name>.*``."""
    tokens = max(args.lengths) + args.steps + 64
    options = dict(max_cached_tokens=tokens, max_batch_size=1, compile_decode=not args.eager)
    models = {f"pages_{f}": flexpage.wrap(zoo.load(args.model), kv_dtype=None if f == "auto" else f, **options)
              for f in args.formats}
    if args.window_model:  # every layer attends a window: the pages before it are given back
        models["window"] = flexpage.wrap(zoo.load(args.window_model), **options)
    if args.groups_model:  # windowed layers beside global ones: the windowed layers' pages before it are given back
        models["groups"] = flexpage.wrap(zoo.load(args.groups_model), **options)
    stock = None if args.no_stock else zoo.load(args.model)
    configs = [*models, *([] if stock is None else ["stock"])]
    records = []
    with tqdm(total=args.rounds * len(args.lengths) * len(configs), desc="cells", unit="cell") as bar:
        for round_ in range(args.rounds):
            for length in args.lengths:
                for config in configs:
                    model = stock if config == "stock" else models[config]
                    cache = fill_stock(model, length, round_) if config == "stock" else fill_paged(model, length, round_)
                    times = decode_ms(model, cache, args.steps + 1, seed=round_)[1:]  # the first step warms
                    if config == "stock":
                        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
                        every_page = sum(t.numel() * t.element_size() for t in kv)
                    else:  # against every layer's K/V kept whole
                        kv = held_kv(cache, cache.batch_rows[0])
                        every_page = cache.seq_length(cache.batch_rows[0]) * sum(
                            pool.shape[1] * pool.shape[3] * pool.element_size()
                            for layer in cache.layers for pool in (layer.keys, layer.values))
                    weights = weight_tensors(model)
                    roof = read_ms(weights + kv)
                    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
                    record = {"config": config, "length": length, "round": round_,
                              "ms": round(statistics.median(times), 3), "roofline_ms": round(roof, 3),
                              "kv_bytes": kv_bytes, "weight_bytes": sum(t.numel() * t.element_size() for t in weights),
                              "kv_bytes_every_page": every_page}
                    if config != "stock" and length <= args.prefill_max:
                        record["ttft_ms"] = round(ttft_ms(model, length, seed=round_), 1)
                    records.append(record)
                    del cache, kv
                    bar.update()
    summary = []
    for length in args.lengths:
        for config in configs:
            runs = [r for r in records if (r["config"], r["length"]) == (config, length)]
            ms, roof = statistics.median(r["ms"] for r in runs), statistics.median(r["roofline_ms"] for r in runs)
            row = {"config": config, "length": length, "ms": round(ms, 3), "roofline_ms": round(roof, 3),
                   "x_roofline": round(ms / roof, 3), "kv_mb": round(runs[0]["kv_bytes"] / 1e6, 2),
                   "kv_held_fraction": round(runs[0]["kv_bytes"] / runs[0]["kv_bytes_every_page"], 4)}
            if "ttft_ms" in runs[0]:
                row["ttft_ms"] = round(statistics.median(r["ttft_ms"] for r in runs), 1)
            summary.append(row)
            print(f"L={length:6d} {config:<12} {row['ms']:9.2f} ms/token  roofline {roof:8.2f} ms  "
                  f"x{row['x_roofline']:.2f}  K/V held {row['kv_mb']} MB ({row['kv_held_fraction']:.3f} of all)",
                  flush=True)
    meta = {"machine": machine_info(), "model": args.model, "window_model": args.window_model,
            "groups_model": args.groups_model, "steps": args.steps,
            "rounds": args.rounds, "command": " ".join(sys.argv), "summary": summary}
    save_run(args, records, meta, plot)


def faithfulness_cells(args: argparse.Namespace) -> None:
    """Quantised pages against the model's dtype; writes ``<name>_agreement.*`` and ``<name>_attention_error.*``."""
    errors, agreement = faithfulness(args.faith_models, args.formats, args.faith_lengths, args.faith_tokens,
                                     args.faith_prompts)
    for f in dict.fromkeys(r["format"] for r in agreement):
        rows = [r for r in agreement if r["format"] == f]
        print(f"{f}: greedy agreement with model-dtype pages, median {statistics.median(r['agree'] for r in rows):.3f} "
              f"free-running, {statistics.median(r['forced_agree'] for r in rows):.3f} teacher-forced "
              f"over {len(rows)} generations of {args.faith_tokens} tokens", flush=True)
    meta = {"machine": machine_info(), "models": args.faith_models, "tokens": args.faith_tokens,
            "command": " ".join(sys.argv)}
    write_records(f"{out_dir(args)}/{args.name}_agreement", agreement, meta)
    write_records(f"{out_dir(args)}/{args.name}_attention_error", errors, meta)
    print(f"wrote {out_dir(args)}/{args.name}_agreement.*, {args.name}_attention_error.*")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--parts", nargs="+", choices=["decode", "faithfulness"], default=["decode", "faithfulness"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192, 32768, 65536])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--window-model", default="mistral-small",
                        help="a zoo model whose every layer attends a sliding window, decoded over model-dtype "
                             "pages beside the others ('' leaves it out)")
    parser.add_argument("--groups-model", default="gemma2-small",
                        help="a zoo model whose layers alternate a sliding window and global attention, decoded "
                             "over model-dtype pages beside the others ('' leaves it out)")
    parser.add_argument("--no-stock", action="store_true", help="leave out stock's dynamic cache")
    parser.add_argument("--eager", action="store_true",
                        help="decode eagerly (default: wrap's compiled static decode step, compile_decode=True)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per cell and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-max", type=int, default=8192, help="the longest context whose TTFT is measured")
    parser.add_argument("--faith-models", nargs="+", default=["llama-small", "qwen3-small", "mistral-small",
                                                              "gemma2-small"],
                        help="zoo models whose greedy tokens are compared (the first: attention-output errors)")
    parser.add_argument("--faith-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--faith-tokens", type=int, default=256)
    parser.add_argument("--faith-prompts", type=int, default=3)
    add_run_arguments(parser, "llama-tiny (and mistral-tiny, gemma2-tiny), lengths 64 and 512, 4 steps, one round",
                      "long",
                      default="results/long")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.lengths, args.steps, args.rounds, args.prefill_max, args.eager = [64, 512], 4, 1, 512, True
        args.window_model = args.window_model and "mistral-tiny"
        args.groups_model = args.groups_model and "gemma2-tiny"
        args.faith_models, args.faith_lengths, args.faith_tokens, args.faith_prompts = [args.model], [64], 16, 1
    if "decode" in args.parts:
        decode_cells(args)
    if "faithfulness" in args.parts and len(args.formats) > 1:
        faithfulness_cells(args)


if __name__ == "__main__":
    main()
