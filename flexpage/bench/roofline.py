"""Decode at the memory roofline: ms per token beside the time this machine needs to read the step's bytes.

A decode step must read every weight it multiplies and the live K/V at least once, so it cannot take
less than those bytes over the speed at which the machine reads memory. For each dtype and context
length L, in one process: the roofline of a step of B sequences — the time of one bandwidth-bound
reduction (``max`` over their bytes) over the very same tensors: the model's weights (the embedding table counted only
where the LM head reads it) and B x L tokens' K/V in a cache pool — and each configuration's decode
time. At batch 1: stock ``generate()`` (dynamic cache), ``wrap``, ``wrap(compile_decode=True)`` (ms per
token: the median gap between generated tokens) and an Engine serving one request; at batch B > 1 an
Engine's decode-only steps of B sequences (ms per step, host work included). Beside it the step's
arithmetic bound: its multiply-adds (every linear layer's weight times B rows, attention over B x L
keys) at the rate of a large GEMM of the same dtype measured in the same process; a step of many
rows cannot beat that either (``x_bound``: the time over the larger of the two). Every cell is
measured once per round, its bounds first, dtypes and configurations in turn (dtypes alternate
within a round, so a drift of the machine's read speed reaches both); each cell's best round is
reported, over its best roofline.

    flexpage bench roofline                    # llama-small, float32 and bfloat16, L 128..2048, batch 1/8/32
    flexpage bench roofline --quick            # llama-tiny, float32, L 64, batch 1 and 2, one round (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, PreTrainedModel

import flexpage
from flexpage import zoo
from flexpage.bench.measure import (TokenClock, add_run_arguments, caption, finish_axes, machine_info,
                                    save_figure, save_run, time_ms)
from flexpage.bench.steps import step_ms

BATCH_ONE = ("stock", "wrap", "wrap_compiled", "engine")  # configurations timed at batch 1
STEP_TOKENS = 512  # the Engine's max_tokens_per_step
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def weight_tensors(model: PreTrainedModel) -> list[torch.Tensor]:
    """The weights a decode step reads whole: every parameter and buffer once, except an input
    embedding table the LM head does not share (a step reads one row of it)."""
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
    seen, tensors = set(), []
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.data_ptr() in seen or tensor is embedding and not tied or not tensor.is_floating_point():
            continue
        seen.add(tensor.data_ptr())
        tensors.append(tensor.detach())
    return tensors


def kv_tensors(cache: flexpage.PagedKVCache, tokens: int) -> list[torch.Tensor]:
    """``tokens`` tokens' keys and values in each layer's pool: the bytes a step over that much context reads."""
    if tokens > cache.page_table.num_pages * cache.page_size:
        raise ValueError(f"{tokens} tokens do not fit the pool of {cache.page_table.num_pages * cache.page_size}")
    return [pool[:, :, :tokens] for layer in cache.layers for pool in (layer.keys, layer.values)]


def as_bytes(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor``'s bytes as contiguous ``uint8`` views (no copy): float, bfloat16 and quantised
    pages alike; a slice of a pool (``[1, heads, tokens, width]``) one view per head, since a
    reduction over strided bytes runs below the read speed."""
    tensor = tensor if tensor.dim() else tensor.reshape(1)
    pieces = [tensor] if tensor.is_contiguous() or tensor.dim() < 3 else tensor.flatten(0, -3).unbind(0)
    return [piece.view(torch.uint8) for piece in pieces]


def read_ms(tensors: list[torch.Tensor], repeats: int = 5) -> float:
    """The median time of one reduction (``max``) over each tensor's bytes: how long this machine
    takes to read them. Bytes, not values: a ``sum`` over bfloat16 converts every value and runs
    below the read speed."""
    views = [piece for tensor in tensors for piece in as_bytes(tensor)]
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for tensor in views:
            tensor.max()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


GEMM_SIZE = 1024  # the square product whose rate stands for the machine's arithmetic


def step_flops(model: PreTrainedModel, batch: int, context: int) -> int:
    """Floating-point operations of a decode step of ``batch`` sequences over ``context`` keys each:
    every linear layer's weight times each row, and each layer's scores and weighted values."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 2 * context * config.num_attention_heads * head_dim * config.num_hidden_layers
    return 2 * batch * (linear + attention)


def gemm_ms_per_gflop(dtype: torch.dtype, repeats: int = 3) -> float:
    """Milliseconds per billion operations of a ``GEMM_SIZE``-square product in ``dtype`` (the best of
    ``repeats``): the rate at which this machine does a step's arithmetic at best."""
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype) for _ in range(2))
    torch.mm(a, b)
    best = min(time_ms(lambda: torch.mm(a, b), repeats))
    return best / (2 * GEMM_SIZE ** 3 / 1e9)


def generate_ms(model: PreTrainedModel, context: int, new_tokens: int) -> float:
    """The median gap between ``generate()``'s tokens (greedy, batch 1, a prompt of ``context`` tokens).
    Every call makes ``new_tokens`` tokens with no end-of-sequence token, as the Engine's requests do
    here, rather than through ``min_new_tokens``, whose two logits processors search the whole
    vocabulary at each token (``torch.isin``), a cost of forcing the length, not of decoding."""
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(context))
    clock = TokenClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, eos_token_id=None,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    if out.shape[1] != context + new_tokens:
        raise RuntimeError(f"generate() made {out.shape[1] - context} tokens, not {new_tokens}")
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:])) * 1e3


def build(model_name: str, dtype: torch.dtype, tokens: int, max_batch: int) -> dict:
    """Each configuration over its own copy of the model (the same seeded weights) in ``dtype``."""
    def load() -> PreTrainedModel:
        return zoo.load(model_name, dtype=dtype)

    return {
        "stock": load(),
        "wrap": flexpage.wrap(load(), max_cached_tokens=tokens),
        "wrap_compiled": flexpage.wrap(load(), max_cached_tokens=tokens, compile_decode=True),
        "engine": flexpage.Engine(load(), max_cached_tokens=max_batch * tokens, max_batch_size=max_batch,
                                  max_tokens_per_step=STEP_TOKENS, prefix_caching=False),
    }


def engine_new_tokens(batch: int, context: int, new_tokens: int) -> int:
    """Tokens each of ``batch`` requests generates so that all of them decode together for about
    ``new_tokens`` steps: the first ones decode while the last prompts are still being prefilled."""
    return new_tokens + -(-batch * context // (STEP_TOKENS - batch))


def measure(configs: dict, config: str, context: int, batch: int, new_tokens: int, seed: int) -> float:
    """One cell: ms per token (batch 1) or per decode step (an Engine's, batch > 1)."""
    if config == "engine":
        return step_ms(configs["engine"], batch, context, engine_new_tokens(batch, context, new_tokens), seed)
    return generate_ms(configs[config], context, new_tokens)


def plot(summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in summary))
    fig, axes = plt.subplots(1, len(dtypes) + 1, figsize=(5 * (len(dtypes) + 1), 4), squeeze=False)
    lengths = sorted({r["length"] for r in summary})
    for ax, dtype in zip(axes[0], dtypes):
        ones = [r for r in summary if r["dtype"] == dtype and r["batch"] == 1]
        for config in BATCH_ONE:
            points = sorted((r["length"], r["ms"]) for r in ones if r["config"] == config)
            ax.plot(*zip(*points), marker="o", label=config)
        roof = [min(r["roofline_ms"] for r in ones if r["length"] == length) for length in lengths]
        ax.plot(lengths, roof, color="black", ls="--", label="roofline (read weights + K/V once)")
        ax.set(xscale="log", xlabel="context tokens", ylabel="ms per token (best round)", title=f"batch 1, {dtype}")
        ax.minorticks_off()
        finish_axes(ax, lengths)
    ax = axes[0][-1]
    for dtype in dtypes:
        for batch in sorted({r["batch"] for r in summary}):
            points = sorted((r["length"], r["x_bound"]) for r in summary
                            if r["dtype"] == dtype and r["batch"] == batch and r["config"] == "engine")
            ax.plot(*zip(*points), marker="o", ls="-" if dtype == "float32" else ":", label=f"Engine, {batch}, {dtype}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xscale="log", xlabel="context tokens", ylabel="step time / its bound (read or arithmetic)",
           title="Engine decode step vs its bound, by batch")
    ax.minorticks_off()
    finish_axes(ax, lengths)
    fig.suptitle(caption(meta), fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                        help="sequences per step (batch 1: every configuration; more: the Engine)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    add_run_arguments(parser, "llama-tiny, float32, length 64, batch 1 and 2, one round", "roofline",
                      default="results/roofline")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.dtypes, args.lengths, args.batches, args.rounds, args.new_tokens = ["float32"], [64], [1, 2], 1, 6
    longest = max(args.lengths)  # a sequence's pages, whole
    tokens = longest + engine_new_tokens(max(args.batches), longest, args.new_tokens) + 64
    cells = [(length, batch, config) for length in args.lengths for batch in args.batches
             for config in (BATCH_ONE if batch == 1 else ("engine",))]
    records = []
    configs = {name: build(args.model, DTYPES[name], tokens, max(args.batches)) for name in args.dtypes}
    weights = {name: weight_tensors(configs[name]["stock"]) for name in args.dtypes}
    with tqdm(total=len(args.dtypes) * args.rounds * len(cells), desc="cells", unit="cell") as bar:
        for round_ in range(args.rounds):
            for name in args.dtypes:
                cache = flexpage.paged_state(configs[name]["engine"].model).cache
                weight_bytes = sum(t.numel() * t.element_size() for t in weights[name])
                for length, batch, config in cells:
                    if config != "engine" and round_ == 0:
                        generate_ms(configs[name][config], length, 2)  # warm: compiles, first touches
                    kv = kv_tensors(cache, batch * length)
                    roof = read_ms(weights[name] + kv)
                    compute = step_flops(configs[name]["stock"], batch, length) / 1e9 * gemm_ms_per_gflop(DTYPES[name])
                    ms = measure(configs[name], config, length, batch, args.new_tokens, seed=round_)
                    records.append({"dtype": name, "length": length, "batch": batch, "config": config,
                                    "round": round_, "ms": round(ms, 3), "roofline_ms": round(roof, 3),
                                    "compute_ms": round(compute, 3), "weight_bytes": weight_bytes,
                                    "kv_bytes": sum(t.numel() * t.element_size() for t in kv)})
                    bar.update()
    del configs, weights
    summary = []
    for name in args.dtypes:
        for length, batch, config in cells:
            runs = [r for r in records if (r["dtype"], r["length"], r["batch"], r["config"]) == (name, length, batch, config)]
            best, roof = min(runs, key=lambda r: r["ms"]), min(r["roofline_ms"] for r in runs)
            compute = min(r["compute_ms"] for r in runs)
            step_bytes = best["weight_bytes"] + best["kv_bytes"]
            row = {"dtype": name, "length": length, "batch": batch, "config": config, "ms": best["ms"],
                   "roofline_ms": roof, "x_roofline": round(best["ms"] / roof, 3), "step_bytes": step_bytes,
                   "read_gb_per_s": round(step_bytes / roof / 1e6, 1), "compute_ms": compute,
                   "x_bound": round(best["ms"] / max(roof, compute), 3)}
            summary.append(row)
            print(f"{name:>8} L={length:5d} B={batch:2d} {config:<14} {row['ms']:8.2f} ms  roofline {roof:7.2f} ms "
                  f"({row['read_gb_per_s']} GB/s)  x{row['x_roofline']:.2f}  arithmetic {compute:7.2f} ms  "
                  f"x{row['x_bound']:.2f} the larger", flush=True)
    meta = {"machine": machine_info(), "model": args.model, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "command": " ".join(sys.argv), "summary": summary}
    save_run(args, records, meta, plot)


if __name__ == "__main__":
    main()
