"""Serving under load: ``flexpage serve`` vs ``transformers serve`` (continuous batching), same model.

The model (and its zoo tokenizer) is saved to a temporary directory; each server is started on
127.0.0.1 on a free port, warmed with one request, then loaded with streamed completions of
random text prompts: Poisson arrivals at each ``--rates`` (requests/s), then closed loops of
``--concurrency`` clients. Every run is bounded in requests and seconds. Reported per point:
request throughput, output tokens/s, TTFT / TPOT / ITL p50 and p99, failures.

    flexpage bench serve              # llama-small, rates 0.25..4 req/s, concurrency 1/4/16
    flexpage bench serve --quick      # llama-tiny, a few requests per point, for CI
    flexpage bench serve --servers flexpage flexpage_unpacked transformers   # also with --no-pack-weights
    flexpage bench serve --temperature 0.7 --top-p 0.9   # sampled completions (greedy by default)
    flexpage bench serve --model llama-tiny --servers flexpage flexpage_json --rates --concurrency 1 16 32 --requests 128 --rounds 4
                                      # the cost of structured outputs: every request held to a JSON schema
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import openai
from tqdm import tqdm

from flexpage import zoo
from flexpage.bench.measure import (
    add_run_arguments, caption, finish_axes, machine_info, out_dir, save_figure, stop_process, write_records)

# flexpage_unpacked: flexpage serve --no-pack-weights; flexpage_json: flexpage serve, each request held to JSON_SCHEMA
SERVERS = ("flexpage", "flexpage_unpacked", "flexpage_json", "transformers")
# one string field: a random-weight model writes it to max_tokens, as long as an unconstrained output
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
               "additionalProperties": False}


@dataclass
class Result:
    ok: bool
    ttft: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between streamed chunks
    error: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(kind: str, model_dir: str, port: int, args: argparse.Namespace) -> list[str]:
    if kind.startswith("flexpage"):
        return [sys.executable, "-m", "flexpage.cli", "serve", model_dir, "--port", str(port), "--served-model-name",
                "model", "--max-batch-size", str(args.max_batch_size), "--max-cached-tokens",
                str(args.max_cached_tokens), "--max-waiting", "100000"] + ["--no-pack-weights"] * (kind == "flexpage_unpacked")
    transformers_cli = os.path.join(os.path.dirname(sys.executable), "transformers")  # installed with transformers
    return [transformers_cli, "serve", model_dir, "--port", str(port),
            "--host", "127.0.0.1", "--continuous-batching", "--device", "cpu", "--dtype", "float32"]


async def wait_ready(client: openai.AsyncOpenAI, process: subprocess.Popen, seconds: float) -> str:
    """The served model's id, once the server answers (bounded in time)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            return (await client.models.list()).data[0].id
        except (openai.APIError, IndexError):
            await asyncio.sleep(0.5)
    raise TimeoutError(f"server not ready after {seconds} s")


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, timeout: float,
                      sampling: dict) -> Result:
    """One streamed completion; ``sampling`` holds its ``temperature`` (and ``top_p``)."""
    start, last, result = time.perf_counter(), None, Result(ok=False)
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True}, timeout=timeout, **sampling)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
                result.tokens = max(result.tokens, len(result.gaps) + 1)
        # an output with no text (a stop token first) is no failure
        result.e2e, result.ok = time.perf_counter() - start, True
    except (openai.APIError, asyncio.TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"[:200]
    return result


async def poisson(client, model, prompts, rate: float, max_tokens: int, seconds: float, seed: int,
                  sampling: dict) -> list[Result]:
    """Requests arriving at ``rate``/s (exponential gaps), all awaited; bounded by ``seconds``."""
    rng, tasks = random.Random(seed), []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one_request(client, model, prompt, max_tokens, seconds, sampling)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def closed_loop(client, model, prompts, concurrency: int, max_tokens: int, seconds: float,
                      sampling: dict) -> list[Result]:
    """``concurrency`` clients, each sending its next request when the last one ends."""
    queue, results = list(prompts), []

    async def worker() -> None:
        while queue:
            results.append(await one_request(client, model, queue.pop(), max_tokens, seconds, sampling))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def summarise(server: str, mode: str, value: float, results: list[Result], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    texted = [r for r in ok if not math.isnan(r.ttft)]  # the outputs that streamed text: their latencies

    def pct(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4) if len(values) > 1 else (
            round(values[0], 4) if values else float("nan"))

    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in texted if r.tokens > 1]
    gaps = [g for r in ok for g in r.gaps]
    return {"server": server, "mode": mode, "value": value, "requests": len(results), "failures": len(results) - len(ok),
            "seconds": round(seconds, 3), "requests_per_s": round(len(ok) / seconds, 4),
            "output_tokens_per_s": round(sum(r.tokens for r in ok) / seconds, 2),
            "ttft_p50_s": pct([r.ttft for r in texted], 50), "ttft_p99_s": pct([r.ttft for r in texted], 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99), "itl_p50_s": pct(gaps, 50),
            "itl_p99_s": pct(gaps, 99), "first_error": next((r.error for r in results if r.error), "")}


def random_prompts(tokenizer, n: int, length: int, seed: int) -> list[str]:
    """``n`` texts of about ``length`` tokens: random ids from the printable part of the vocabulary, decoded."""
    rng = random.Random(seed)
    ids = [i for i in range(3, len(tokenizer)) if tokenizer.decode([i]).isprintable()]
    return [tokenizer.decode([rng.choice(ids) for _ in range(length)]) for _ in range(n)]


async def load_server(kind: str, model_dir: str, args: argparse.Namespace, prompts: list[str], bar) -> list[dict]:
    port = free_port()
    log = open(os.path.join(model_dir, f"{kind}.log"), "w")
    process = subprocess.Popen(server_command(kind, model_dir, port, args), stdout=log, stderr=subprocess.STDOUT)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    rows = []
    try:
        model = await wait_ready(client, process, args.start_timeout)
        sampling = request_options(kind, args)
        await one_request(client, model, prompts[0], 4, args.point_timeout, sampling)  # loads / compiles what it must
        points = [("rate", r) for r in args.rates] + [("concurrency", c) for c in args.concurrency]
        for mode, value in points:
            start = time.perf_counter()
            if mode == "rate":
                work = poisson(client, model, prompts, value, args.output_len, args.point_timeout, args.seed, sampling)
            else:
                work = closed_loop(client, model, prompts, int(value), args.output_len, args.point_timeout, sampling)
            results = await work
            rows.append(summarise(kind, mode, value, results, time.perf_counter() - start))
            bar.set_postfix_str(f"{kind} {mode}={value}: {rows[-1]['output_tokens_per_s']} tok/s")
            bar.update()
    finally:
        await client.close()  # its connections close on this loop, not when it is collected after
        stop_process(process, 30)
        log.close()
    return rows


def sampling_options(args: argparse.Namespace) -> dict:
    """The completions' sampling fields: greedy (temperature 0) unless ``--temperature`` says otherwise."""
    return {"temperature": args.temperature} | ({} if args.top_p is None else {"top_p": args.top_p})


def request_options(kind: str, args: argparse.Namespace) -> dict:
    """What every completion sent to server ``kind`` carries besides its prompt and length."""
    structured = {"extra_body": {"structured_outputs": {"json": JSON_SCHEMA}}} if kind == "flexpage_json" else {}
    return sampling_options(args) | structured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=["flexpage", "transformers"])
    parser.add_argument("--rates", type=float, nargs="*", default=[0.25, 0.5, 1.0, 2.0, 4.0], help="requests/s")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16], help="closed-loop clients")
    parser.add_argument("--requests", type=int, default=32, help="requests per point")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32, help="flexpage's Engine")
    parser.add_argument("--max-cached-tokens", type=int, default=32768, help="flexpage's Engine")
    parser.add_argument("--point-timeout", type=float, default=600, help="seconds a request may take")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to start")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="each server this many times, in turn (ABBA...): medians per point, drift cancelled")
    add_run_arguments(parser, "llama-tiny, 6 requests per point, 2 rates, 1 concurrency", "serve",
                      default="results/serve")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.rates, args.concurrency, args.requests, args.input_len, args.output_len = [2.0, 8.0], [4], 6, 32, 8
    rows = []
    with tempfile.TemporaryDirectory(prefix="flexpage-serve-") as model_dir:
        zoo.load(args.model).save_pretrained(model_dir)
        tokenizer = zoo.load_tokenizer(args.model)
        tokenizer.save_pretrained(model_dir)
        prompts = random_prompts(tokenizer, args.requests, args.input_len, args.seed)
        points = len(args.servers) * (len(args.rates) + len(args.concurrency)) * args.rounds
        with tqdm(total=points, desc="load points") as bar:
            for round_ in range(args.rounds):  # the servers in turn, the order reversed each round
                for kind in args.servers if round_ % 2 == 0 else args.servers[::-1]:
                    try:
                        rows += [row | {"round": round_} for row in
                                 asyncio.run(load_server(kind, model_dir, args, prompts, bar))]
                    except (RuntimeError, TimeoutError) as error:
                        log = open(os.path.join(model_dir, f"{kind}.log")).read()[-1500:]
                        print(f"{kind} server failed: {error}\n{log}", file=sys.stderr)
                        rows.append({"server": kind, "mode": "start", "value": 0, "failures": 1,
                                     "first_error": str(error), "round": round_})
    meta = {"machine": machine_info(), "model": args.model, "command": " ".join(sys.argv),
            "input_len": args.input_len, "output_len": args.output_len, "requests_per_point": args.requests,
            "rounds": args.rounds,
            "sampling": sampling_options(args), "json_schema": JSON_SCHEMA if "flexpage_json" in args.servers else None,
            "flexpage": {"max_batch_size": args.max_batch_size, "max_cached_tokens": args.max_cached_tokens},
            "transformers": "transformers serve --continuous-batching (defaults)"}
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, rows, meta)
    print_summary(rows)
    plot(medians(rows), meta, stem)
    print(f"wrote {stem}.csv, {stem}.json, {stem}.png")


def medians(rows: list[dict]) -> list[dict]:
    """One row per server and load point: each measure's median over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["server"], row["mode"], row["value"]), []).append(row)
    return [dict(same[0]) | {key: statistics.median(r[key] for r in same) for key, value in same[0].items()
                             if isinstance(value, float) and key != "value"} for same in groups.values()]


def print_summary(rows: list[dict]) -> None:
    for r in rows:
        if r["mode"] == "start":
            print(f"{r['server']:>12} did not start: {r['first_error']}")
            continue
        print(f"{r['server']:>13} {r['mode']:>11}={r['value']:<5} round {r.get('round', 0)}: "
              f"{r['requests_per_s']:6.3f} req/s "
              f"{r['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p99 {r['ttft_p50_s']}/{r['ttft_p99_s']} s  "
              f"TPOT p50 {r['tpot_p50_s']} s  failures {r['failures']}")


def plot(rows: list[dict], meta: dict, stem: str) -> None:
    """Output tokens/s and p99 TTFT against the offered request rate (or, without rates, the
    closed-loop clients), one line per server, as ``<stem>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mode = "rate" if any(r["mode"] == "rate" for r in rows) else "concurrency"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for server in dict.fromkeys(r["server"] for r in rows):
        points = sorted((r for r in rows if r["server"] == server and r["mode"] == mode), key=lambda r: r["value"])
        for ax, key in zip(axes, ("output_tokens_per_s", "ttft_p99_s")):
            ax.plot([r["value"] for r in points], [r[key] for r in points], "o-", label=f"{server} serve")
    axes[1].set_yscale("log")  # an overloaded server's TTFT is seconds to minutes, a keeping-up one's milliseconds
    for ax, label in zip(axes, ("output tokens / s", "TTFT p99 (s)")):
        ax.set(xlabel="offered load (requests / s, Poisson)" if mode == "rate" else "concurrent clients (closed loop)",
               ylabel=label)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        finish_axes(ax, sorted({r["value"] for r in rows if r["mode"] == mode}), "{:g}".format)
    sampled = ", ".join(f"{k} {v}" for k, v in meta.get("sampling", {}).items() if v)  # temperature 0: greedy
    fig.suptitle(f"serving, {meta['input_len']} in / {meta['output_len']} out tokens, {sampled or 'greedy'}, "
                 f"{meta['requests_per_point']} requests per point"
                 + (f", medians of {meta['rounds']} rounds" if meta.get("rounds", 1) > 1 else "") + " — "
                 f"{caption(meta)}", fontsize=9)
    save_figure(fig, f"{stem}.png")
