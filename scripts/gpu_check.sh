#!/usr/bin/env bash
# One-shot GPU check (under 9 minutes on one H200): the CUDA tests, then short latency and
# throughput benchmarks on the GPU; everything lands in results/gpu/.
#
#   bash scripts/gpu_check.sh
#
# Needs a CUDA build of torch already installed (pip would otherwise pull whatever it likes).
# flexpage runs from this checkout; its other dependencies are installed only if missing, from
# PyPI or from the wheels in $WHEELS.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=results/gpu

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch (or no torch installed); nothing to check on this machine." >&2
  exit 2
fi
mkdir -p "$OUT"
missing=$(python - <<'PY'
import importlib.util
need = {"transformers": "transformers", "accelerate": "accelerate", "einops": "einops", "tqdm": "tqdm",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "matplotlib": "matplotlib", "numpy": "numpy"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  pip install --quiet ${WHEELS:+--no-index --find-links "$WHEELS"} $missing || { echo "gpu_check: could not install: $missing" >&2; exit 2; }
fi
python - <<'PY' | tee "$OUT/device.txt"
import torch, transformers
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
PY

status=0
workers=$(python -c "import importlib.util as u; print('-n 6' if u.find_spec('xdist') else '')")
timeout 170 python -m pytest -q $workers -p no:cacheprovider tests/test_cuda.py tests/test_gpu_layout.py \
  --junitxml "$OUT/tests.xml" >"$OUT/tests.txt" 2>&1 || status=$?
tail -15 "$OUT/tests.txt"
lengths="128 512 2048 4096"
timeout 150 python -m flexpage.cli bench latency --device cuda --lengths $lengths --new-tokens 32 --repeats 2 \
  --configs flexpage flexpage_engine stock_dynamic_sdpa stock_static_compiled --out "$OUT" \
  >"$OUT/latency.txt" 2>&1 || status=$?
tail -12 "$OUT/latency.txt"
# the compiled decode forward (CUDA graphs) beside stock's static cache + torch.compile, in a process of its own
timeout 150 python -m flexpage.cli bench latency --device cuda --lengths $lengths --new-tokens 32 --repeats 2 \
  --configs flexpage_compiled stock_dynamic_sdpa stock_static_compiled --name latency_compiled --out "$OUT" \
  >"$OUT/latency_compiled.txt" 2>&1 || status=$?
tail -8 "$OUT/latency_compiled.txt"
timeout 100 python -m flexpage.cli bench throughput --device cuda --requests 16 --prompt-range 64 1024 --output-range 16 128 --batch-sizes 8 16 --out "$OUT" \
  >"$OUT/throughput.txt" 2>&1 || status=$?
tail -12 "$OUT/throughput.txt"
echo "gpu_check: results in $OUT (exit status $status)"
exit $status
