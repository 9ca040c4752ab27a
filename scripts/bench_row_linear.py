"""flexpage's few-row linear kernel against the library GEMMs, over a model's own weights.

For each row count, every linear weight of the model (float32 or bfloat16, in model order, so each
is as cold in cache as a forward leaves it) multiplies that many random rows through each kernel:
F.linear (MKL, or oneDNN's bfloat16 GEMM), oneDNN's matmul on the weight as it is, and
``kernels.row_linear``; beside them one read of the same weights (``bench.roofline.read_ms``'s
reduction). Kernels alternate within each round; the median round is reported, in ms per pass
over all the weights and in GB/s of weight read. ``--base REV`` adds the kernel's source at that git
revision, built as flexpage builds it, and the largest difference between the two builds' outputs.

    python scripts/bench_row_linear.py --dtype bfloat16 --rows 1 2 4 8 32 --rounds 9
    python scripts/bench_row_linear.py --dtype bfloat16 --rows 1 2 4 8 16 --rounds 21 --base d6f1201
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from flexpage import zoo
from flexpage.bench.roofline import as_bytes
from flexpage.core import kernels, linear

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "flexpage/core/row_linear.c"


def read(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One read of ``weight``'s bytes (the roofline's reduction)."""
    for view in as_bytes(weight):
        view.max()


def base_build(revision: str, directory: Path) -> ctypes.CDLL:
    """``row_linear.c`` at ``revision``, compiled as flexpage compiles it, with its entry points' signatures."""
    source, built = directory / "base.c", directory / "base.so"
    source.write_text(subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout)
    subprocess.run([kernels.compiler() or "cc", *kernels.flags(), "-o", str(built), str(source), "-lm"], check=True)
    lib = ctypes.CDLL(str(built))
    for entry, (argtypes, restype) in kernels.ENTRY_POINTS["row_linear"].items():
        getattr(lib, entry).argtypes, getattr(lib, entry).restype = argtypes, restype
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--base", help="also time row_linear.c at this git revision")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not kernels.row_linear_available(dtype):
        raise SystemExit(f"the {args.dtype} kernel is not built here (it needs a compiler; float32 an AVX2 core, "
                         "bfloat16 an AVX512-BF16 one)")
    model = zoo.build(args.model, dtype=dtype)
    weights = [m.weight.detach() for m in model.modules() if type(m) is nn.Linear]
    products = {"F.linear": linear.plain_linear, "onednn": linear.onednn_linear, "kernel": kernels.row_linear,
                "read": read}
    with tempfile.TemporaryDirectory() as directory:
        if args.base:
            products[f"kernel@{args.base}"] = functools.partial(kernels.row_linear, lib=base_build(args.base,
                                                                                                   Path(directory)))
        measure(args, weights, products, dtype)


def measure(args: argparse.Namespace, weights: list[torch.Tensor], products: dict, dtype: torch.dtype) -> None:
    nbytes = sum(w.nbytes for w in weights)
    print(f"{args.model}: {len(weights)} weights, {nbytes / 1e6:.0f} MB {args.dtype}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {w.shape[1] for w in weights}}
            seconds = {name: [] for name in products}
            for round_ in range(args.rounds):
                for name, product in (products.items() if round_ % 2 == 0 else reversed(products.items())):
                    start = time.perf_counter()
                    for weight in weights:
                        product(inputs[weight.shape[1]], weight, None)
                    seconds[name].append(time.perf_counter() - start)
            cells = [f"{name} {statistics.median(s) * 1e3:.2f} ms ({nbytes / statistics.median(s) / 1e9:.0f} GB/s)"
                     for name, s in seconds.items()]
            if args.base:
                differ = max((products["kernel"](inputs[w.shape[1]], w, None).float()
                              - products[f"kernel@{args.base}"](inputs[w.shape[1]], w, None).float()).abs().max().item()
                             for w in weights)
                cells.append(f"outputs differ by {differ:.1e}")
            print(f"rows {rows:3d}: " + " | ".join(cells), flush=True)

if __name__ == "__main__":
    main()
