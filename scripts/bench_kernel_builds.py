"""Two builds of flexpage's decode kernel, alternated call by call in one process: the source at a
git revision (``--base``) against this checkout's, each built with the flags flexpage builds it
with. One call attends ``llama-small``'s head shape (8 query heads over 2 KV heads of 64) over
float32, bfloat16 (a bfloat16 query), int8 or float8 pages; each cell is the median of ``--rounds``
calls, beside one read of the same K/V bytes (``bench.roofline.read_ms``). The outputs of the two
builds are compared too (their largest difference).

    python scripts/bench_kernel_builds.py --base HEAD~1 --rounds 21
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's flexpage, installed or not

import torch  # noqa: E402

from flexpage.bench.roofline import read_ms  # noqa: E402
from flexpage.core import kernels  # noqa: E402
from flexpage.core.quant import quantise  # noqa: E402

SOURCE = "flexpage/core/decode_attention.c"
CASES = [(32, 512), (1, 512), (1, 32768)]  # (decode tokens, keys each)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "float8": torch.float8_e4m3fn}
FLOAT8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # older sources' float8 table


def build(source: str, directory: Path, name: str) -> tuple[ctypes.CDLL, bool, bool, bool]:
    """``source`` compiled as flexpage compiles its kernels, loaded with the entry point's signature;
    and whether it takes the ``bf16_query`` and ``cap`` arguments (sources before them did not) and
    a float8 value table after the format (sources before commit 883fe0c did)."""
    path, built = directory / f"{name}.c", directory / f"{name}.so"
    path.write_text(source)
    subprocess.run([kernels.compiler() or "cc", *kernels.flags(), "-o", str(built), str(path), "-lm"], check=True)
    lib = ctypes.CDLL(str(built))
    entry = lib.flexpage_decode_attention
    argtypes, entry.restype = kernels.ENTRY_POINTS["decode_attention"]["flexpage_decode_attention"]
    flagged, capped, table = "bf16_query" in source, "float cap" in source, "int format, const float *lut" in source
    argtypes = argtypes[:15] + [ctypes.c_void_p] + argtypes[15:] if table else argtypes  # the table follows the format
    argtypes = argtypes if capped else argtypes[:12] + argtypes[13:]  # the cap follows the scale
    entry.argtypes = argtypes if flagged else argtypes[:-2] + argtypes[-1:]
    return lib, flagged, capped, table


def attend(built: tuple[ctypes.CDLL, bool, bool, bool], query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           first: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """``kernels.decode_attention``'s call, through ``built``'s library."""
    lib, flagged, capped, table = built
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    folded = query.reshape(rows, kv_heads, heads // kv_heads, dim).float().contiguous()
    out = torch.empty_like(folded)
    part_keys = max(kernels.PART_KEYS, kernels.cdiv(int(runs[1].sum()) * kv_heads, 4 * torch.get_num_threads()))
    status = lib.flexpage_decode_attention(
        folded.data_ptr(), keys.data_ptr(), values.data_ptr(), rows, kv_heads, keys.shape[2], dim, heads // kv_heads,
        first.data_ptr(), runs[0].data_ptr(), runs[1].data_ptr(), dim ** -0.5, *([0.0] if capped else []), part_keys,
        kernels.FORMATS[keys.dtype], *([FLOAT8_VALUES.data_ptr()] if table else []),
        *([query.dtype == torch.bfloat16] if flagged else []), out.data_ptr())
    if status:
        raise RuntimeError(f"flexpage_decode_attention failed with status {status}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernel source is the baseline")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    base = subprocess.run(["git", "show", f"{args.base}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    with tempfile.TemporaryDirectory() as directory:
        builds = [build(base, Path(directory), "base"), build((ROOT / SOURCE).read_text(), Path(directory), "new")]
        torch.manual_seed(0)
        for rows, width in CASES:
            for name, dtype in DTYPES.items():
                keys, values = torch.randn(2, 1, 2, rows * width, 64).unbind(0)
                keys, values = ((quantise(keys, dtype), quantise(values, dtype)) if dtype in (torch.int8, torch.float8_e4m3fn)
                                else (keys.to(dtype), values.to(dtype)))
                query = torch.randn(rows, 8, 1, 64, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
                first = torch.arange(rows + 1)
                runs = torch.stack([torch.arange(rows) * width, torch.full((rows,), width)])
                outs = [attend(built, query, keys, values, first, runs) for built in builds]
                times: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for built, samples in zip(builds, times):
                        start = time.perf_counter()
                        attend(built, query, keys, values, first, runs)
                        samples.append((time.perf_counter() - start) * 1e6)
                before, after = (statistics.median(samples) for samples in times)
                read = read_ms([keys, values], repeats=9) * 1e3
                print(f"{rows:3d} x {width:6d} keys, {name:8s}: {args.base} {before:7.0f} us -> {after:7.0f} us "
                      f"({after / before:.2f}x; one read of its K/V {read:5.0f} us; outputs differ by "
                      f"{(outs[0] - outs[1]).abs().max().item():.1e})", flush=True)


if __name__ == "__main__":
    main()
