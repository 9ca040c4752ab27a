"""Decode after a cached prefix: keys attended where they lie in runs of pages, or gathered.

A request whose prompt extends a cached prefix holds the prefix's pages and, after them, pages
taken wherever the pool had them: its keys lie in two runs of consecutive pages. This measures the
Engine's decode ms/token for such a request with the runs attended in place (``masks.RUN_TOKENS``
as shipped) against gathering them (the threshold raised past any context), alternated in one
process, median of each round's median step.

    python scripts/bench_page_runs.py --lengths 4096 8192 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flexpage, installed or not

import flexpage  # noqa: E402
from flexpage import zoo  # noqa: E402
from flexpage.bench.speculative import decode_run, prompts_of  # noqa: E402
from flexpage.bench.throughput import fixed_length_model  # noqa: E402
from flexpage.core import masks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    model = zoo.chosen_model(args)
    shipped = masks.RUN_TOKENS
    for length in args.lengths:
        engine = flexpage.Engine(fixed_length_model(model), max_cached_tokens=4 * length + 2048, max_batch_size=8,
                                 max_tokens_per_step=1024)
        vocab = engine.model.config.vocab_size
        prefix = prompts_of(1, length, vocab, seed=0)[0]
        engine.generate([prefix], max_new_tokens=1)  # cached: later prompts extending it hold its pages
        times = {"runs": [], "gather": []}
        for round_ in range(args.rounds):
            for i, (name, threshold) in enumerate((("runs", shipped), ("gather", 1 << 62))):
                masks.RUN_TOKENS = threshold
                prompt = prefix + prompts_of(1, 16, vocab, seed=1 + 2 * round_ + i)[0]
                _, seconds, _ = decode_run(engine, [prompt], args.new_tokens)
                times[name].append(statistics.median(seconds) * 1e3)
        masks.RUN_TOKENS = shipped
        runs, gather = (statistics.median(times[name]) for name in ("runs", "gather"))
        print(f"{model} L={length}: runs {runs:.2f} ms/token, gathered {gather:.2f} ms/token ({runs / gather:.2f}x)")


if __name__ == "__main__":
    main()
