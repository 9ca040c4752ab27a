"""Decode steps, compiled vs eager, at every decode bucket: ms per Engine step of ``rows`` sequences.

Two Engines over two copies of the model (the same seeded weights): one whose decode-only steps
run the compiled static step (``compile_decode=True``), one whose steps all run eagerly
(``compile_decode=False``). For each row count, each Engine serves that many requests (prompts of
``--context`` tokens, ``--new-tokens`` each) and its decode-only steps with every sequence decoding
are timed (``Engine.step``, host work included); the median step is the run's figure. The two
Engines alternate, their order flipping every round; each configuration's best round is reported.

    flexpage bench steps                 # llama-small, rows 1..32, 3 rounds
    flexpage bench steps --quick         # llama-tiny, rows 1 and 2, one round (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

import flexpage
from flexpage import zoo
from flexpage.bench.measure import add_run_arguments, caption, finish_axes, machine_info, save_figure, save_run

CONFIGS = {"compiled": True, "eager": False}  # name -> Engine(compile_decode=...)


def step_ms(engine: flexpage.Engine, rows: int, context: int, new_tokens: int, seed: int) -> float:
    """The median ms of ``engine``'s decode-only steps while ``rows`` requests all decode."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(rows):
        engine.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(),
                           flexpage.SamplingParams(max_new_tokens=new_tokens, eos_token_id=[]))
    times = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        last = engine.history[-1]
        if last.prefill_tokens == 0 and last.decode_tokens == rows:
            times.append(seconds)
    return statistics.median(times[1:] or times) * 1e3  # the first decode step after a prefill is colder


def plot(summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ratio_ax) = plt.subplots(1, 2, figsize=(10, 4))
    rows = sorted({r["rows"] for r in summary})
    for config in CONFIGS:
        ax.plot(rows, [next(r["ms_per_step"] for r in summary if r["rows"] == n and r["config"] == config)
                       for n in rows], marker="o", label=config)
    ax.set(xscale="log", xlabel="sequences decoding (rows)", ylabel="ms per step (best round's median)",
           title="Decode step, compiled vs eager")
    finish_axes(ax, rows)
    ratios = [next(r["compiled_over_eager"] for r in summary if r["rows"] == n and r["config"] == "compiled")
              for n in rows]
    ratio_ax.bar([str(n) for n in rows], ratios, color="tab:green")
    ratio_ax.axhline(1.0, color="black", lw=0.8)
    ratio_ax.set(xlabel="sequences decoding (rows)", ylabel="compiled / eager", title="Compiled step / eager step")
    fig.suptitle(caption(meta), fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each request")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens each request generates")
    parser.add_argument("--rounds", type=int, default=3)
    add_run_arguments(parser, "llama-tiny, rows 1 and 2, one round", "steps", default="results/steps")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.rows, args.rounds, args.context, args.new_tokens = [1, 2], 1, 32, 6
    engines = {name: flexpage.Engine(zoo.load(args.model), max_cached_tokens=max(args.rows) * (args.context + 64),
                                     max_batch_size=max(args.rows), max_tokens_per_step=512, compile_decode=compiled)
               for name, compiled in CONFIGS.items()}
    records = []
    with tqdm(total=args.rounds * len(args.rows) * len(CONFIGS), desc="runs", unit="run") as bar:
        for round_ in range(args.rounds):
            order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
            for rows in args.rows:
                for config in order:
                    ms = step_ms(engines[config], rows, args.context, args.new_tokens, seed=round_)
                    records.append({"rows": rows, "config": config, "round": round_, "ms_per_step": round(ms, 3)})
                    bar.update()
    summary = []
    for rows in args.rows:
        best = {c: min(r["ms_per_step"] for r in records if r["rows"] == rows and r["config"] == c) for c in CONFIGS}
        for config in CONFIGS:
            summary.append({"rows": rows, "config": config, "ms_per_step": best[config],
                            "compiled_over_eager": round(best["compiled"] / best["eager"], 3)})
        print(f"rows {rows:3d}: compiled {best['compiled']:7.2f} ms, eager {best['eager']:7.2f} ms, "
              f"ratio {best['compiled'] / best['eager']:.2f}", flush=True)
    meta = {"machine": machine_info(), "model": args.model, "context": args.context, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "command": " ".join(sys.argv), "summary": summary}
    save_run(args, records, meta, plot)


if __name__ == "__main__":
    main()
