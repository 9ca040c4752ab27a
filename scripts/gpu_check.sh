#!/usr/bin/env bash
# One-shot GPU check: the CUDA tests, then short latency and throughput benchmarks on the GPU;
# everything lands in results/gpu/. Each stage has its own time limit and they sum to 7.5 minutes
# (200 + 100 + 90 + 60 s), so give the whole call at least 8.5: a run cut off from outside returns
# nothing. Each stage prints when it starts, so a slow one is named.
#
#   bash scripts/gpu_check.sh            # PYTHON=... to choose the interpreter (default python3)
#
# Needs a CUDA build of torch already installed (pip would otherwise pull whatever it likes).
# flexpage runs from this checkout; its other dependencies are installed only if missing, from
# PyPI or from the wheels in $WHEELS.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=results/gpu
PY=${PYTHON:-python3}
stage() { echo "gpu_check: $(date +%T) $*"; }
status=0
run_stage() {  # NAME LIMIT_S LOG TAIL_LINES COMMAND...: one stage under its own limit; its log's tail shown
  local name=$1 limit=$2 log=$3 lines=$4
  shift 4
  stage "$name (limit $limit s)"
  timeout "$limit" "$@" >"$log" 2>&1 || status=$?
  tail -"$lines" "$log"
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch (or no torch installed); nothing to check on this machine." >&2
  exit 2
fi
mkdir -p "$OUT"
missing=$($PY - <<'PY'
import importlib.util
need = {"transformers": "transformers", "accelerate": "accelerate", "tqdm": "tqdm",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "matplotlib": "matplotlib", "numpy": "numpy"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  $PY -m pip install --quiet ${WHEELS:+--no-index --find-links "$WHEELS"} $missing || { echo "gpu_check: could not install: $missing" >&2; exit 2; }
fi
$PY - <<'PY' | tee "$OUT/device.txt"
import torch, transformers
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
PY

workers=$($PY -c "import importlib.util as u; print('-n 6' if u.find_spec('xdist') else '')")
run_stage "CUDA tests" 200 "$OUT/tests.txt" 15 $PY -m pytest -q $workers -p no:cacheprovider \
  tests/test_cuda.py tests/test_gpu_layout.py --junitxml "$OUT/tests.xml"
latency=(-m flexpage.cli bench latency --device cuda --lengths 128 512 2048 --new-tokens 32 --repeats 2 --out "$OUT")
run_stage "latency" 100 "$OUT/latency.txt" 12 $PY "${latency[@]}" \
  --configs flexpage flexpage_engine stock_dynamic_sdpa stock_static_compiled
# wrap(compile_decode=True), its decode steps replayed as CUDA graphs, beside stock's static cache +
# torch.compile, in a process of its own
run_stage "latency, compiled" 90 "$OUT/latency_compiled.txt" 8 $PY "${latency[@]}" \
  --configs flexpage_compiled stock_dynamic_sdpa stock_static_compiled --name latency_compiled
run_stage "throughput" 60 "$OUT/throughput.txt" 12 $PY -m flexpage.cli bench throughput --device cuda --requests 16 \
  --prompt-range 64 1024 --output-range 16 128 --batch-sizes 8 16 --out "$OUT"
stage "done: results in $OUT (exit status $status)"
exit $status
