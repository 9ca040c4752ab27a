"""``flexpage``: one command, with subcommands.

    flexpage generate            wrapped vs stock generate() on a zoo model (tokens must agree)
    flexpage serve MODEL         an OpenAI-compatible server on the Engine (pip install flexpage[serve])
    flexpage bench latency       latency vs context length, flexpage vs stock
    flexpage bench throughput    many mixed requests: the Engine vs stock batching
    flexpage bench prefix        shared prefixes, with and without prefix caching
    flexpage bench attention     one layer's paged attention vs contiguous kernels
    flexpage bench startup       fresh process to first token, cold and warm compile cache
    flexpage bench steps         decode steps at every bucket: compiled vs eager
    flexpage bench serve         HTTP load: flexpage serve vs transformers serve
    flexpage bench tp            tensor parallelism: decode latency at tp=1 vs 2, KV capacity per rank
    flexpage bench speculative   speculative decoding: verify cost, speed-up at known acceptance, assisted generate()
    flexpage bench roofline      decode time beside the time to read its weights and K/V once, fp32 and bf16
    flexpage bench long          decode to 64k tokens over model-dtype, int8 and fp8 pages; their faithfulness
    flexpage bench dtypes        batch-1 decode and prefill, float32 vs bfloat16, stock vs flexpage, on this CPU

``flexpage <command> --help`` lists a command's options. ``--model`` takes a zoo name or a local
``save_pretrained`` directory; ``--quick`` runs a few seconds of work on the tiny model and writes
into a temporary directory unless ``--out`` is given.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"generate": "flexpage.bench.generate", "serve": "flexpage.serve.cli"}
BENCHMARKS = {name: f"flexpage.bench.{name}" for name in ("latency", "throughput", "prefix", "attention", "startup",
                                                                  "steps", "serve", "tp", "speculative",
                                                                  "roofline", "long", "dtypes")}
HELP = ("-h", "--help")


def _run(prog: str, module: str, argv: list[str]) -> int:
    sys.argv = [prog, *argv]  # argparse's usage line and the results' recorded "command"
    importlib.import_module(module).main(argv)
    return 0


def _usage(message: str | None = None) -> int:
    if message:
        print(f"flexpage: {message}\n", file=sys.stderr)
    print(__doc__.strip(), file=sys.stderr if message else sys.stdout)
    return 2 if message else 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``flexpage <command> [<benchmark>] [options]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        return _usage("a command is required")
    if argv[0] in HELP:
        return _usage()
    if argv[0] in COMMANDS:
        return _run(f"flexpage {argv[0]}", COMMANDS[argv[0]], argv[1:])
    if argv[0] != "bench":
        return _usage(f"unknown command {argv[0]!r}")
    if len(argv) < 2:
        return _usage(f"bench needs one of: {', '.join(BENCHMARKS)}")
    if argv[1] in HELP:
        return _usage()
    if argv[1] not in BENCHMARKS:
        return _usage(f"unknown benchmark {argv[1]!r}; choose from {', '.join(BENCHMARKS)}")
    return _run(f"flexpage bench {argv[1]}", BENCHMARKS[argv[1]], argv[2:])


if __name__ == "__main__":
    sys.exit(main())
