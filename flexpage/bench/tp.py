"""Tensor parallelism: ``wrap`` decode latency at tp=1 vs tp=2, and the KV capacity each rank holds.

The model is saved to a temporary directory and loaded under ``torchrun`` (gloo on CPU, NCCL on
GPUs) with transformers' ``DistributedConfig(tp_size=N)``; each configuration generates the same
prompt, and rank 0 reports time to first token and the median decode time per token (medians
over repeats), with the KV bytes one token costs on each rank and the tokens a GiB of KV holds.
On a 2-core CPU tp=2 gives each rank one core and adds two all-reduces per layer, so it is not
faster; what it buys is the capacity: each rank holds 1/tp of every token's K/V.

    flexpage bench tp            # llama-small, 512-token prompt, 32 new tokens, 3 repeats
    flexpage bench tp --quick    # llama-tiny, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import flexpage
from flexpage import zoo
from flexpage.bench.measure import TokenClock, add_run_arguments, machine_info, out_dir, write_records


def worker(model_dir: str, tp: int, length: int, new_tokens: int, repeats: int, result: str) -> None:
    """Under torchrun: load, wrap, time ``generate``; rank 0 writes the result as JSON."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LogitsProcessorList
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    options = {"distributed_config": DistributedConfig(tp_size=tp)} if tp > 1 else {}
    model = flexpage.wrap(AutoModelForCausalLM.from_pretrained(model_dir, **options).eval(),
                          max_cached_tokens=length + new_tokens + 64)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(repeats + 1):  # the first is a warm-up
        clock, start = TokenClock(), time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
        gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
        runs.append(((clock.times[0] - start) * 1e3, statistics.median(gaps) * 1e3))
    cache = flexpage.paged_state(model).cache
    kv_bytes = 2 * len(cache.layers) * cache.num_kv_heads * cache.head_dim * cache.dtype.itemsize
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump({"tp": tp, "threads_per_rank": torch.get_num_threads(), "kv_heads_per_rank": cache.num_kv_heads,
                       "ttft_ms": round(statistics.median(r[0] for r in runs[1:]), 2),
                       "decode_ms_per_token": round(statistics.median(r[1] for r in runs[1:]), 2),
                       "kv_bytes_per_token_per_rank": kv_bytes,
                       "kv_tokens_per_gib_per_rank": (1 << 30) // kv_bytes}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    parser.add_argument("--length", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "RESULT"), help=argparse.SUPPRESS)
    add_run_arguments(parser, "llama-tiny, 64-token prompt, 8 new tokens, 1 repeat", "tp", default="results/tp")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.new_tokens, args.repeats = 64, 8, 1
    if args.worker:
        worker(args.worker[0], int(os.environ["WORLD_SIZE"]), args.length, args.new_tokens, args.repeats,
               args.worker[1])
        return
    args.model = zoo.chosen_model(args)
    records = []
    with tempfile.TemporaryDirectory(prefix="flexpage-tp-") as tmp:
        zoo.load(args.model).save_pretrained(tmp)
        for tp in args.tp:
            result = os.path.join(tmp, f"tp{tp}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
                       "-m", "flexpage.cli", "bench", "tp", "--worker", tmp, result, "--length", str(args.length),
                       "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
            for attempt in (1, 2):  # a launch whose rank aborts in start-up (seen rarely under a long test run) runs again
                done = subprocess.run(command, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
                if done.returncode == 0:
                    break
                print(f"tp={tp}: torchrun exited with {done.returncode} (attempt {attempt})", file=sys.stderr, flush=True)
            done.check_returncode()
            with open(result) as f:
                records.append(json.load(f))
            print(records[-1], flush=True)
    meta = {"machine": machine_info(), "model": args.model, "command": " ".join(sys.argv), "length": args.length,
            "new_tokens": args.new_tokens, "repeats": args.repeats}
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, records, meta)
    print(f"wrote {stem}.csv, {stem}.json")
