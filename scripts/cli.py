"""``flexpage-bench``: the benchmark scripts as one command.

    flexpage-bench latency --quick        # latency vs context length (scripts/bench_latency.py)
    flexpage-bench throughput --quick     # many mixed requests (scripts/bench_throughput.py)
    flexpage-bench prefix --quick         # shared prefixes (scripts/bench_prefix.py)
    flexpage-bench attention --quick      # one layer's paged attention (scripts/bench_attention.py)
    flexpage-bench startup --quick        # fresh process to first token, cold and warm (scripts/bench_startup.py)
    flexpage-bench generate               # wrapped vs stock generate() (scripts/generate.py)

Each subcommand takes its script's options (``flexpage-bench latency --help``); ``--model``
takes a zoo name or a local ``save_pretrained`` directory.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "latency": "scripts.bench_latency",
    "throughput": "scripts.bench_throughput",
    "prefix": "scripts.bench_prefix",
    "attention": "scripts.bench_attention",
    "startup": "scripts.bench_startup",
    "generate": "scripts.generate",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command, rest = argv[0], argv[1:]
    sys.argv = [f"flexpage-bench {command}", *rest]  # argparse's usage line and the results' "command"
    importlib.import_module(COMMANDS[command]).main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
