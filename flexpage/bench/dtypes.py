"""Every dtype on this CPU: batch-1 decode and prefill, stock vs flexpage, float32 vs bfloat16.

A model in float32 and in bfloat16 (the same seeded weights), each as stock ``generate()``,
``wrap(compile_decode=True)`` and an Engine serving one request, in one process. Per cell: decode
ms per token at a context of ``--length`` tokens (the median gap between tokens; the Engine's
median decode step) and the prefill of a ``--prompt``-token prompt (ms to its first token). Cells
alternate within a round (a configuration's two dtypes side by side, their order flipped every
round), and each cell's median round is reported with its ratios to stock and bfloat16's to
float32: the median of the ratios within each round. The CPU's tier
(``flexpage.core.cpu``: the instruction sets its kernels were chosen for) is in the run's meta.

    flexpage bench dtypes                                     # llama-small, L 512, prompt 512, 5 rounds
    flexpage bench dtypes --model llama-1b --configs stock engine   # the 1B model (two copies per dtype)
    flexpage bench dtypes --quick                             # llama-tiny, L 64, one round (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

import flexpage
from flexpage import zoo
from flexpage.bench.measure import add_run_arguments, caption, finish_axes, machine_info, save_figure, save_run
from flexpage.bench.roofline import DTYPES, generate_ms
from flexpage.bench.steps import step_ms

CONFIGS = ("stock", "wrap_compiled", "engine")


def build(model_name: str, dtype: torch.dtype, configs: list[str], tokens: int, step_tokens: int) -> dict:
    """Each configuration over its own copy of the model in ``dtype``."""
    def load() -> PreTrainedModel:
        return zoo.load(model_name, dtype=dtype)

    makers = {"stock": load,
              "wrap_compiled": lambda: flexpage.wrap(load(), max_cached_tokens=tokens, max_batch_size=1,
                                                     compile_decode=True),
              "engine": lambda: flexpage.Engine(load(), max_cached_tokens=tokens, max_batch_size=2,
                                                max_tokens_per_step=step_tokens, prefix_caching=False)}
    return {config: makers[config]() for config in configs}


def prefill_ms(target: PreTrainedModel | flexpage.Engine, prompt: int, seed: int) -> float:
    """Ms from a ``prompt``-token prompt to its first token (a ``generate()`` of one token, or the
    Engine's request of one token)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(target, flexpage.Engine):
        ids = torch.randint(3, target.model.config.vocab_size, (prompt,), generator=g).tolist()
        start = time.perf_counter()
        target.generate([ids], max_new_tokens=1)
        return (time.perf_counter() - start) * 1e3
    ids = torch.randint(3, target.config.vocab_size, (1, prompt), generator=g)
    start = time.perf_counter()
    with torch.inference_mode():
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
    return (time.perf_counter() - start) * 1e3


def decode_ms(target: PreTrainedModel | flexpage.Engine, length: int, new_tokens: int, seed: int) -> float:
    """Batch-1 decode ms per token at a context of ``length`` tokens."""
    if isinstance(target, flexpage.Engine):
        return step_ms(target, 1, length, new_tokens, seed)
    return generate_ms(target, length, new_tokens)


def plot(summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in summary))
    dtypes = list(dict.fromkeys(r["dtype"] for r in summary))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(dtypes)
    for ax, (field, label) in zip(axes, (("decode_ms", f"decode ms per token (L {meta['length']})"),
                                         ("prefill_ms", f"ms to first token ({meta['prompt']}-token prompt)"))):
        for n, dtype in enumerate(dtypes):
            values = [next(r[field] for r in summary if r["config"] == c and r["dtype"] == dtype) for c in configs]
            ax.bar([i + n * width for i in range(len(configs))], values, width, label=dtype)
        ax.set(ylabel=label, title=label.split(" (")[0])
        finish_axes(ax, [i + width * (len(dtypes) - 1) / 2 for i in range(len(configs))],
                    lambda position: configs[round(position - width * (len(dtypes) - 1) / 2)])
    fig.suptitle(caption(meta), fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--length", type=int, default=512, help="context tokens of the decode cells")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill cells")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per decode measurement")
    parser.add_argument("--rounds", type=int, default=5)
    add_run_arguments(parser, "llama-tiny, L 64, prompt 64, one round", "dtypes", default="results/dtypes")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.length, args.prompt, args.new_tokens, args.rounds = 64, 64, 6, 1
    # (quick: the pool and step of ``tests/tier_worker.py``'s Engine, whose compiled steps it then shares)
    tokens = 512 if args.quick else max(args.length, args.prompt) + args.new_tokens + 64
    step_tokens = max(args.prompt, 64)
    built = {name: build(args.model, DTYPES[name], args.configs, tokens, step_tokens)
             for name in tqdm(args.dtypes, desc="models", unit="dtype")}
    records = []
    with tqdm(total=args.rounds * len(args.dtypes) * len(args.configs), desc="cells", unit="cell") as bar:
        for round_ in range(args.rounds):
            for config in args.configs:
                for name in args.dtypes if round_ % 2 == 0 else reversed(args.dtypes):
                    target = built[name][config]
                    if round_ == 0:  # warm: first touches, the kernels' rankings, lazily compiled buckets
                        decode_ms(target, args.length, 3, seed=-1)
                        prefill_ms(target, args.prompt, seed=-1)
                    records.append({"dtype": name, "config": config, "round": round_,
                                    "decode_ms": round(decode_ms(target, args.length, args.new_tokens, round_), 3),
                                    "prefill_ms": round(prefill_ms(target, args.prompt, round_), 3)})
                    bar.update()
    del built
    summary = []
    for name in args.dtypes:
        for config in args.configs:
            runs = [r for r in records if r["dtype"] == name and r["config"] == config]
            summary.append({"dtype": name, "config": config,
                            "decode_ms": round(statistics.median(r["decode_ms"] for r in runs), 2),
                            "prefill_ms": round(statistics.median(r["prefill_ms"] for r in runs), 1)})
    for row in summary:  # ratios of cells measured in the same round (a burst of the machine hits both), median
        for field in ("decode_ms", "prefill_ms"):
            for suffix, other in (("x_stock", ("stock", row["dtype"])), ("x_float32", (row["config"], "float32"))):
                pairs = [(ours[field], theirs[field]) for ours in records for theirs in records
                         if (ours["config"], ours["dtype"]) == (row["config"], row["dtype"])
                         and (theirs["config"], theirs["dtype"]) == other and theirs["round"] == ours["round"]]
                if pairs:
                    row[f"{field}_{suffix}"] = round(statistics.median(a / b for a, b in pairs), 3)
        print(f"{row['dtype']:>8} {row['config']:<14} decode {row['decode_ms']:8.2f} ms/token "
              f"(x{row.get('decode_ms_x_stock', float('nan')):.2f} stock, "
              f"x{row.get('decode_ms_x_float32', float('nan')):.2f} float32)  prefill {row['prefill_ms']:8.1f} ms "
              f"(x{row.get('prefill_ms_x_stock', float('nan')):.2f} stock, "
              f"x{row.get('prefill_ms_x_float32', float('nan')):.2f} float32)", flush=True)
    meta = {"machine": machine_info(), "model": args.model, "length": args.length, "prompt": args.prompt,
            "new_tokens": args.new_tokens, "rounds": args.rounds, "command": " ".join(sys.argv), "summary": summary}
    save_run(args, records, meta, plot)


if __name__ == "__main__":
    main()
