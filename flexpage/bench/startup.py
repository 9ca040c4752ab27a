"""Start-up: seconds from a fresh process to its first generated token, cold and warm.

Each configuration runs in its own new Python process, twice: *cold* with an empty inductor
compile cache (a first run on a new machine), then *warm* with the cache the cold run left
(every later process). Reported per run: seconds to import, to build the model, and from the
model being ready to the first token (for the Engine this includes its warm-up, which
compiles or loads every step shape; its own seconds are reported too).

    flexpage bench startup               # llama-small: stock, wrap, Engine
    flexpage bench startup --quick       # llama-tiny, stock and wrap only, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from flexpage import zoo
from flexpage.bench.measure import add_run_arguments, machine_info, out_dir, write_records

CONFIGS = ("stock", "wrap", "engine")
# What one child process runs: build the model, then time to the first token of a 300-token prompt.
CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch, flexpage
from flexpage import zoo
from transformers import LogitsProcessorList
from flexpage.bench.measure import TokenClock
imported = time.perf_counter()
config, model_name = sys.argv[1], sys.argv[2]
model = zoo.load(model_name)
built = time.perf_counter()
ids = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
warmup = 0.0
if config == "engine":
    engine = flexpage.Engine(model, max_cached_tokens=16384, max_batch_size=int(sys.argv[3]), max_tokens_per_step=512)
    warmup = engine.stats().warmup_seconds
    next(iter(engine.stream([ids[0].tolist()], max_new_tokens=2)))
    first = time.perf_counter()
else:
    clock = TokenClock()
    target = flexpage.wrap(model) if config == "wrap" else model
    target.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    first = clock.times[0]
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "first_token_s": first - built,
                  "engine_warmup_s": warmup, "total_s": first - start}))
"""


def run_child(config: str, model: str, cache_dir: str, engine_batch: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD, config, model, str(engine_batch)], env=env,
                         check=True, capture_output=True, text=True, timeout=1800)
    return {k: round(v, 4) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--engine-batch", type=int, default=32, help="Engine max_batch_size (its decode shapes)")
    add_run_arguments(parser, "llama-tiny, stock and wrap only", "startup", default="results/startup")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.configs = [c for c in args.configs if c != "engine"]
    records = []
    for config in args.configs:
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:  # empty: a cold start
            for start in ("cold", "warm"):
                result = run_child(config, args.model, cache_dir, args.engine_batch)
                records.append({"config": config, "start": start, **result})
                print(f"{config:>7} {start}: {result}", flush=True)
    meta = {"machine": machine_info(), "model": args.model, "engine_batch": args.engine_batch,
            "command": " ".join(sys.argv)}
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, records, meta)
    print(f"wrote {stem}.csv, {stem}.json")


if __name__ == "__main__":
    main()
