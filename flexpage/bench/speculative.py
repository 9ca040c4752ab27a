"""Speculative decoding: what verifying drafted tokens costs, and what it buys at a known acceptance.

The zoo's weights are random, so acceptance on real text cannot be measured honestly here.
Three measurements instead, every speculative run's tokens checked against the plain run's:

* verify: an Engine step in which every sequence verifies ``k`` drafted tokens (all accepted)
  against a plain decode step, at each batch size and context length;
* acceptance: decode tokens/s of the Engine whose drafts are the model's own next tokens, each
  with probability alpha (else a wrong token), against the plain Engine: drafts of ``k`` tokens
  each step (fixed), and adaptive drafts (shortened, then paused, as they fail: the default);
* assisted: batch-1 ``generate()`` on a prompt that repeats itself, with prompt lookup and with an
  assistant of the same weights (every draft accepted): stock on a dynamic cache beside ``wrap``,
  and the Engine with n-gram speculation.

    flexpage bench speculative            # llama-small (~10 min)
    flexpage bench speculative --quick    # llama-tiny, small grid, for CI
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

import flexpage
from flexpage import SamplingParams, zoo
from flexpage.bench.measure import (add_run_arguments, caption, machine_info, matmul_probe_ms, out_dir, save_figure,
                                    time_ms, write_records)
from flexpage.bench.throughput import fixed_length_model

KEY = 16  # leading tokens that name a prompt (the prompts are random: distinct)


class Oracle:
    """A proposer that knows each prompt's greedy continuation (``learn``) and drafts its tokens,
    each right with probability ``alpha`` (else the token after it in the vocabulary), seeded by
    prompt and position so every run drafts the same."""

    def __init__(self, vocab_size: int, alpha: float = 1.0) -> None:
        self.vocab_size, self.alpha, self.known = vocab_size, alpha, {}

    def learn(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]]) -> None:
        for prompt, output in zip(prompts, outputs):
            self.known[tuple(prompt[:KEY])] = prompt + output

    def __call__(self, tokens: Sequence[int], k: int) -> list[int]:
        key = tuple(tokens[:KEY])
        full, name = self.known[key], hash(key)
        drafts = []
        for pos in range(len(tokens), min(len(tokens) + k, len(full))):
            right = random.Random(name * 100_003 + pos).random() < self.alpha
            drafts.append(full[pos] if right else (full[pos] + 1) % self.vocab_size)
        return drafts


def prompts_of(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def decode_run(engine: flexpage.Engine, prompts: list[list[int]], new_tokens: int, timed_steps: int | None = None
               ) -> tuple[list[list[int]], list[float], int]:
    """Serve ``prompts`` greedily; once every prompt has its first token, time the decode steps (the
    first ``timed_steps``, then the requests are aborted; or all). Returns the outputs (so far),
    the timed steps' seconds and the tokens those steps produced."""
    indices = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    outputs = {i: [] for i in indices}
    steps, produced = [], 0
    while engine.has_work:
        if timed_steps is not None and len(steps) == timed_steps:
            engine.abort(indices)
            break
        timed = all(outputs.values())
        start = time.perf_counter()
        records = engine.step()
        if timed:
            steps.append(time.perf_counter() - start)
            produced += len(records)
        for r in records:
            outputs[r.index].append(r.token)
    return [outputs[i] for i in indices], steps, produced


def verify_cost(engines: dict[int, flexpage.Engine], oracle: Oracle, batches, lengths, steps: int, repeats: int,
                vocab: int) -> list[dict]:
    """Step time with every sequence verifying ``k`` accepted drafts, against a plain decode step."""
    records = []
    ks = sorted(engines)
    new_tokens = steps * (max(ks) + 1) + 2
    for batch in batches:
        for length in lengths:
            prompts = prompts_of(batch, length, vocab, seed=batch * 7919 + length)
            reference, _, _ = decode_run(engines[0], prompts, new_tokens)
            oracle.learn(prompts, reference)
            oracle.alpha = 1.0
            samples = {k: [] for k in ks}
            for _ in tqdm(range(repeats), desc=f"verify b={batch} L={length}", leave=False):
                for k in ks:  # interleaved
                    outputs, seconds, _ = decode_run(engines[k], prompts, new_tokens, timed_steps=steps)
                    assert all(ref[: len(out)] == out for ref, out in zip(reference, outputs)), f"k={k}: tokens changed"
                    samples[k].append(statistics.median(seconds) * 1e3)
            plain = statistics.median(samples[0])
            for k in ks:
                step = statistics.median(samples[k])
                records.append({"measure": "verify", "batch": batch, "length": length, "k": k,
                                "step_ms": round(step, 3), "vs_decode_step": round(step / plain, 3)})
    return records


def acceptance(plain: flexpage.Engine, fixed: flexpage.Engine, adaptive: flexpage.Engine, oracle: Oracle,
               batches, length: int, alphas, new_tokens: int, repeats: int, vocab: int) -> list[dict]:
    """Decode ms per token of the plain Engine and of speculation at each acceptance ``alpha``."""
    records = []
    for batch in batches:
        prompts = prompts_of(batch, length, vocab, seed=batch)
        reference, _, _ = decode_run(plain, prompts, new_tokens)
        oracle.learn(prompts, reference)
        configs = {"plain": (plain, None)} | {f"{name} a={a}": (engine, a) for a in alphas
                                              for name, engine in (("fixed", fixed), ("adaptive", adaptive))}
        samples = {name: [] for name in configs}
        stats = {}
        for _ in tqdm(range(repeats), desc=f"acceptance b={batch}", leave=False):
            for name, (engine, alpha) in configs.items():  # interleaved
                oracle.alpha = alpha if alpha is not None else 1.0
                engine.reset_stats()
                outputs, seconds, produced = decode_run(engine, prompts, new_tokens)
                assert outputs == reference, f"{name}: speculation changed tokens"
                samples[name].append(sum(seconds) / produced * 1e3)
                stats[name] = engine.stats()
        base = statistics.median(samples["plain"])
        for name, (_, alpha) in configs.items():
            ms = statistics.median(samples[name])
            records.append({"measure": "acceptance", "batch": batch, "length": length, "config": name.split()[0],
                            "alpha": alpha, "decode_ms_per_token": round(ms, 3), "speedup": round(base / ms, 3),
                            "acceptance_rate": round(stats[name].acceptance_rate, 3),
                            "tokens_per_verification": round(stats[name].tokens_per_verification, 3)})
    return records


def assisted(model_name: str, length: int, new_tokens: int, k: int, repeats: int) -> list[dict]:
    """Batch-1 generate(): stock and wrap, plain, prompt lookup and a same-weights assistant; the
    Engine plain and with n-gram speculation; a prompt whose 64-token block repeats."""
    stock, paged = fixed_length_model(model_name), flexpage.wrap(fixed_length_model(model_name))
    helpers = {"stock": fixed_length_model(model_name), "wrap": flexpage.wrap(fixed_length_model(model_name))}
    block = prompts_of(1, 64, stock.config.vocab_size, seed=3)[0]
    prompt = (block * (length // 64 + 1))[:length]
    ids = torch.tensor([prompt])
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    cells = {}
    for side, model in (("stock", stock), ("wrap", paged)):
        cells[f"{side} plain"] = lambda m=model: m.generate(ids, **options)
        cells[f"{side} prompt lookup"] = lambda m=model: m.generate(ids, prompt_lookup_num_tokens=k, **options)
        cells[f"{side} assistant"] = lambda m=model, s=side: m.generate(ids, assistant_model=helpers[s],
                                                                         num_assistant_tokens=k, **options)
    engines = {name: flexpage.Engine(fixed_length_model(model_name), max_cached_tokens=4 * (length + new_tokens),
                                     max_batch_size=2, max_tokens_per_step=max(512, length), speculative=spec,
                                     num_speculative_tokens=k)
               for name, spec in (("engine plain", None), ("engine ngram", "ngram"))}
    for name, engine in engines.items():
        cells[name] = lambda e=engine: e.generate([prompt], max_new_tokens=new_tokens)
    expected = stock.generate(ids, **options)[0, length:].tolist()
    for name, fn in cells.items():  # every path gives the same tokens (and is warmed up)
        out = fn()
        got = out[0] if name.startswith("engine") else out[0, length:].tolist()
        assert got == expected, f"{name} changed tokens"
    samples = {name: [] for name in cells}
    for _ in tqdm(range(repeats), desc="assisted", leave=False):
        for name, fn in cells.items():
            samples[name] += time_ms(fn, 1)
    ngram = engines["engine ngram"].stats()
    return [{"measure": "assisted", "config": name, "length": length, "k": k,
             "ms_per_token": round(statistics.median(samples[name]) / new_tokens, 3),
             "acceptance_rate": round(ngram.acceptance_rate, 3) if name == "engine ngram" else None}
            for name in cells]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="drafted tokens to verify")
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.8, 0.5, 0.0])
    parser.add_argument("--acceptance-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="verify steps timed per run")
    parser.add_argument("--repeats", type=int, default=3)
    add_run_arguments(parser, "llama-tiny, batches 1 and 4, lengths 64 and 128, k 2 and 4", default="results/speculative")
    args = parser.parse_args(argv)
    args.model = zoo.chosen_model(args)
    if args.quick:
        args.batches, args.lengths, args.ks, args.alphas = [1, 4], [64, 128], [2, 4], [1.0, 0.0]
        args.acceptance_batches, args.new_tokens, args.steps, args.repeats = [1, 4], 16, 2, 1

    most = max(args.batches + args.acceptance_batches)
    longest = max(args.lengths) + args.steps * (max(args.ks) + 1) + args.new_tokens + 8
    common = dict(max_cached_tokens=most * longest, max_batch_size=most,
                  max_tokens_per_step=max(512, most * (max(args.ks) + 1)))
    engines = {0: flexpage.Engine(fixed_length_model(args.model), **common)}
    vocab = engines[0].model.config.vocab_size
    oracle = Oracle(vocab)
    for k in args.ks:
        engines[k] = flexpage.Engine(fixed_length_model(args.model), speculative=oracle, num_speculative_tokens=k,
                                     adaptive_speculation=False, **common)
    k4 = 4 if 4 in args.ks else max(args.ks)
    adaptive = flexpage.Engine(fixed_length_model(args.model), speculative=oracle, num_speculative_tokens=k4, **common)
    probes = [matmul_probe_ms()]
    records = verify_cost(engines, oracle, args.batches, args.lengths, args.steps, args.repeats, vocab)
    probes.append(matmul_probe_ms())
    records += acceptance(engines[0], engines[k4], adaptive, oracle, args.acceptance_batches, 512 if not args.quick else 64,
                          args.alphas, args.new_tokens, args.repeats, vocab)
    probes.append(matmul_probe_ms())
    del engines, adaptive
    records += assisted(args.model, 512 if not args.quick else 128, args.new_tokens, k4, args.repeats)
    probes.append(matmul_probe_ms())
    meta = {"machine": machine_info(), "model": args.model, "k_acceptance": k4, "new_tokens": args.new_tokens,
            "steps": args.steps, "repeats": args.repeats, "matmul_probe_ms": [round(p, 3) for p in probes],
            "command": " ".join(sys.argv)}
    stem = os.path.join(out_dir(args), "speculative")
    write_records(stem, records, meta)
    plot(records, meta, stem)
    for r in records:
        print({k: v for k, v in r.items() if v is not None})
    print(f"wrote {stem}.csv, {stem}.json, {stem}.png")


def plot(records: list[dict], meta: dict, stem: str) -> None:
    """Verify cost against k, decode speed-up against alpha, and batch-1 generate() per path, as ``<stem>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    verify = [r for r in records if r["measure"] == "verify"]
    for batch in sorted({r["batch"] for r in verify}):
        for length in sorted({r["length"] for r in verify}):
            rows = sorted((r for r in verify if r["batch"] == batch and r["length"] == length), key=lambda r: r["k"])
            axes[0].plot([r["k"] for r in rows], [r["vs_decode_step"] for r in rows], marker="o",
                         label=f"batch {batch}, L={length}")
    axes[0].set(xlabel="drafted tokens verified per sequence (k)", ylabel="step time / plain decode step",
                title="cost of verifying k drafts")
    accept = [r for r in records if r["measure"] == "acceptance" and r["config"] != "plain"]
    for batch in sorted({r["batch"] for r in accept}):
        for config in ("fixed", "adaptive"):
            rows = sorted((r for r in accept if r["batch"] == batch and r["config"] == config), key=lambda r: r["alpha"])
            axes[1].plot([r["alpha"] for r in rows], [r["speedup"] for r in rows], marker="o",
                         linestyle="-" if config == "adaptive" else "--", label=f"batch {batch}, {config} drafts")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set(xlabel="probability a drafted token is right (alpha)", ylabel="decode speed-up vs no speculation",
                title=f"k = {meta['k_acceptance']}: what acceptance buys")
    assist = [r for r in records if r["measure"] == "assisted"]
    axes[2].barh([r["config"] for r in assist], [r["ms_per_token"] for r in assist])
    axes[2].invert_yaxis()
    axes[2].set(xlabel="ms per generated token (batch 1)", title="assisted generate(), a repeating prompt")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].grid(axis="x", alpha=0.3)
    fig.suptitle(f"speculative decoding — {caption(meta)}", fontsize=9)
    save_figure(fig, f"{stem}.png")


if __name__ == "__main__":
    main()
