"""flexpage's C decode kernel against the kernels it replaced, alternated in one process.

Part 1, batch-1 decode over a long context (``bench long``'s filled caches, ``wrap``): ms/token
over float32 pages with the kernel (as shipped: called from C++, ``flexpage::paged_decode``), with
the kernel called through ``ctypes`` (the C++ op off, the lone token's threshold lowered to one key)
and with SDPA (the C++ op off, the threshold raised past any context), and over int8 pages (the
kernel). Part 2, the Engine's decode-only steps with
several requests (``bench steps``' measure, eager steps): every row's keys through the kernel in
one call (as shipped) against FlexAttention's CPU template. Each cell: median of each round's
median step.

    python scripts/bench_decode_kernel.py --lengths 8192 32768 --rows 8 32 --context 512 --new-tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flexpage, installed or not

import torch  # noqa: E402

import flexpage  # noqa: E402
from flexpage import zoo  # noqa: E402
from flexpage.bench.long import decode_ms, fill_paged  # noqa: E402
from flexpage.bench.steps import step_ms  # noqa: E402
from flexpage.core import attention, policy  # noqa: E402


def alternated(configs: dict, measure, rounds: int) -> dict[str, float]:
    """``measure(policy, ...)`` of each configuration, alternated over ``rounds``: medians."""
    results: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in (list(configs) if round_ % 2 == 0 else list(reversed(configs))):
            results[name].append(measure(name, round_))
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each request in part 2")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens each request generates in part 2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.model = zoo.chosen_model(args)
    shipped = policy.CPU_POLICY
    no_lone_kernel = dataclasses.replace(shipped, lone_decode_kernel_keys=1 << 62)
    lone_kernel = dataclasses.replace(shipped, lone_decode_kernel_keys=1)
    native = attention.native_ops_loaded
    no_row_kernel = dataclasses.replace(shipped, decode_kernel_dtypes=frozenset({torch.int8, torch.float8_e4m3fn}))

    tokens = max(args.lengths) + 64
    models = {kv: flexpage.wrap(zoo.load(args.model), kv_dtype=kv, max_cached_tokens=tokens, max_batch_size=1)
              for kv in (None, "int8")}
    lone = {"float32 kernel": (None, shipped, native), "float32 kernel by ctypes": (None, lone_kernel, lambda: False),
            "float32 SDPA": (None, no_lone_kernel, lambda: False), "int8 kernel": ("int8", shipped, native)}
    for length in args.lengths:
        def one(name: str, round_: int) -> float:
            kv, policy.CPU_POLICY, attention.native_ops_loaded = lone[name]
            model = models[kv]
            return statistics.median(decode_ms(model, fill_paged(model, length, round_), 7, seed=round_)[1:])
        ms = alternated(lone, one, args.rounds)
        print(f"batch 1, L={length}: " + ", ".join(f"{name} {value:.1f} ms ({value / ms['float32 SDPA']:.2f}x)"
                                                   for name, value in ms.items()), flush=True)

    engine = flexpage.Engine(zoo.load(args.model), max_cached_tokens=max(args.rows) * (args.context + args.new_tokens + 64),
                             max_batch_size=max(args.rows), max_tokens_per_step=512, compile_decode=False)
    batched = {"kernel": shipped, "FlexAttention": no_row_kernel}
    for rows in args.rows:
        def step(name: str, round_: int) -> float:
            policy.CPU_POLICY = batched[name]
            return step_ms(engine, rows, args.context, args.new_tokens, seed=round_)
        ms = alternated(batched, step, args.rounds)
        print(f"Engine, {rows} rows of {args.context}-token prompts: kernel {ms['kernel']:.1f} ms a step, "
              f"FlexAttention {ms['FlexAttention']:.1f} ms ({ms['kernel'] / ms['FlexAttention']:.2f}x)", flush=True)
    policy.CPU_POLICY, attention.native_ops_loaded = shipped, native


if __name__ == "__main__":
    main()
