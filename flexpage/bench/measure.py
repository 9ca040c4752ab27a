"""Timing, probes, counters and result files shared by the benchmarks and notebooks.

These VMs have bursts of slowdown lasting minutes, so measurements interleave the
configurations they compare, repeat, take medians, and time a small matmul probe before
and after each cell: a cell whose probe ran slow is measured again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor

from ..core import cpu
from ..engine import Engine
from ..engine.requests import SamplingParams


def engine_generate(engine: Engine, prompts: list[list[int]], max_new_tokens: list[int] | int
                    ) -> tuple[list[list[int]], list[float]]:
    """``engine.generate(prompts, max_new_tokens, progress=True)`` (greedy), and each prompt's
    seconds from submission to its first token (from the step records)."""
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    position = {engine.add_request(p, SamplingParams(max_new_tokens=n)): i for i, (p, n) in enumerate(zip(prompts, counts))}
    outputs, ttft = [[] for _ in prompts], [0.0] * len(prompts)
    with tqdm(total=len(prompts), desc="requests", unit="req") as bar:
        for record in engine.run():
            i = position[record.index]
            outputs[i].append(record.token)
            if record.first_token_seconds is not None:
                ttft[i] = record.first_token_seconds
            bar.update(record.finish_reason is not None)
    return outputs, ttft


def matmul_probe_ms(size: int = 256, repeats: int = 5) -> float:
    """Median time of a fixed small matmul: a yardstick for how fast the machine is right now."""
    a = torch.randn(size, size)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


@dataclass
class Timing:
    samples_ms: list[float] = field(default_factory=list)  # one median per round
    remeasured: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else float("nan")


def interleaved(
    cells: dict[str, Callable[[], object]],
    rounds: int = 5,
    repeats: int = 20,
    warmup: int = 3,
    probe_tolerance: float = 1.5,
    max_retries: int = 3,
) -> dict[str, Timing]:
    """Time every cell once per round, round-robin, so slow spells hit all cells alike.

    A cell's round is re-measured (up to ``max_retries`` times) when the probe before or
    after it is ``probe_tolerance`` x slower than the fastest probe seen so far.
    """
    for fn in cells.values():
        for _ in range(warmup):
            fn()
    best_probe = matmul_probe_ms()
    timings = {name: Timing() for name in cells}
    for _ in range(rounds):
        for name, fn in cells.items():
            for attempt in range(max_retries + 1):
                before = matmul_probe_ms()
                median = statistics.median(time_ms(fn, repeats))
                after = matmul_probe_ms()
                best_probe = min(best_probe, before, after)
                if max(before, after) <= probe_tolerance * best_probe or attempt == max_retries:
                    break
                timings[name].remeasured += 1
            timings[name].samples_ms.append(median)
    return timings


def compiled_graphs() -> int:
    """Graphs compiled or loaded in this process: dynamo's, and flexpage's ahead-of-time kernels
    (difference two readings to count recompiles)."""
    from torch._dynamo.utils import counters

    from flexpage.core.compile import graph_counts

    return counters["stats"]["unique_graphs"] + graph_counts()["held"]


class TokenClock(LogitsProcessor):
    """Timestamps each generated token (logits processors run once per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class PeakMemory:
    """Peak memory above the start while the block runs, in MB: on a CUDA device the allocator's
    high-water mark; on CPU the process's resident memory, sampled in a thread."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.002) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = self.peak = torch.cuda.memory_allocated()
            return self
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def machine_info() -> dict:
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": cpu.model_name(),
        "cpu_tier": cpu.tier(),  # the instruction sets flexpage's kernels were chosen for (``flexpage.core.cpu``)
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def caption(meta: dict) -> str:
    """What a figure was measured on, for its title: model, machine, threads, versions."""
    m = meta["machine"]
    tier = f", {m['cpu_tier']}" if m.get("cpu_tier") else ""
    device = m.get("cuda") or f"{m['cpu_count']} CPU cores ({m['processor']}{tier}), {m['torch_threads']} threads"
    model = f"{meta['model']}, " if "model" in meta else ""
    return f"{model}{device}, torch {m['torch']}"


def add_run_arguments(parser: argparse.ArgumentParser, quick: str, name: str | None = None, *,
                      default: str) -> None:
    """The options every benchmark shares: ``--quick`` (what it shrinks to: ``quick``); ``--out``,
    by default the benchmark's committed results folder (``default``) for a full run and a new
    temporary directory for ``--quick``, so a trial run never overwrites the measured figures;
    ``--name``, the stem of the result files (when the benchmark has one, ``name`` by default)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", help=f"directory for the CSV/JSON/PNG results (default: {default}; "
                                      "with --quick, a new temporary directory)")
    parser.set_defaults(default_out=default)
    if name is not None:
        parser.add_argument("--name", default=name, help="stem of the result files")


def finish_axes(ax, xticks: list, label: Callable[[object], str] = str) -> None:
    """Explicit x tick labels (a log axis would print powers), a light grid, the legend."""
    ax.set_xticks(xticks, [label(x) for x in xticks])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path: str) -> None:
    """Lay out, write the PNG and release the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stop_process(process: subprocess.Popen, seconds: float) -> None:
    """Terminate ``process`` and wait for it; kill it if it has not exited after ``seconds``."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def out_dir(args: argparse.Namespace) -> str:
    """The directory chosen by ``add_run_arguments``'s ``--out`` (created)."""
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="flexpage-quick-") if getattr(args, "quick", False) else args.default_out
    os.makedirs(args.out, exist_ok=True)
    return args.out


def notebook_results(benchmark: str, committed: str) -> tuple[dict, str, str]:
    """The results a notebook draws, the directory they are in, and a directory for its figures.

    By default the committed full run (``committed``, a JSON path such as ``../results/latency/latency.json``),
    with figures drawn into a temporary directory so the committed PNGs stay as measured. With
    ``FLEXPAGE_NOTEBOOK_QUICK=1`` (CI): the benchmark's ``--quick`` results in
    ``FLEXPAGE_NOTEBOOK_OUT``, running ``flexpage bench <benchmark> --quick`` first if none are there.
    """
    if os.environ.get("FLEXPAGE_NOTEBOOK_QUICK") == "1":
        out = os.environ["FLEXPAGE_NOTEBOOK_OUT"]
        path = os.path.join(out, os.path.basename(committed))
        if not os.path.exists(path):
            subprocess.run([sys.executable, "-m", "flexpage.cli", "bench", benchmark, "--quick", "--out", out],
                           check=True)
        figures = out
    else:
        path, figures = committed, tempfile.mkdtemp(prefix="flexpage-figures-")
    with open(path) as f:
        return json.load(f), os.path.dirname(path), figures


def save_run(args: argparse.Namespace, records: list[dict], meta: dict, plot: Callable[[list[dict], dict, str], None]
             ) -> None:
    """Write a run into its results folder (``out_dir``) as ``<--name>.csv`` / ``.json`` (the records,
    with ``meta``) and its figure, ``plot(meta["summary"], meta, "<--name>.png")``."""
    stem = os.path.join(out_dir(args), args.name)
    write_records(stem, records, meta)
    plot(meta["summary"], meta, stem + ".png")
    print(f"wrote {stem}.csv, {stem}.json, {stem}.png")


def write_records(path_stem: str, records: list[dict], meta: dict) -> None:
    """Write ``records`` as ``<stem>.csv`` and, with ``meta``, as ``<stem>.json``."""
    import csv

    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    columns = list(dict.fromkeys(k for r in records for k in r))
    with open(path_stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)
    with open(path_stem + ".json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=2, default=str)


__all__ = ["PeakMemory", "Timing", "TokenClock", "add_run_arguments", "caption", "compiled_graphs", "finish_axes", "interleaved",
           "machine_info", "matmul_probe_ms", "notebook_results", "out_dir", "save_figure", "stop_process", "time_ms", "write_records"]
