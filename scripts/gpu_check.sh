#!/usr/bin/env bash
# One-shot GPU check (under 8 minutes on one H200): the CUDA tests, then short latency and
# throughput benchmarks on the GPU; everything lands in results/gpu/.
#
#   bash scripts/gpu_check.sh
#
# Needs a CUDA build of torch already installed (pip would otherwise pull whatever it likes);
# installs flexpage and its test dependencies next to it, from PyPI or from wheels in $WHEELS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/gpu
mkdir -p "$OUT"
python - <<'PY' | tee "$OUT/device.txt"
import torch, transformers
assert torch.cuda.is_available(), "no CUDA GPU visible"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
PY
pip install --quiet ${WHEELS:+--no-index --find-links "$WHEELS"} --no-build-isolation -e ".[dev]" 2>&1 | tail -3 || \
  pip install --quiet ${WHEELS:+--no-index --find-links "$WHEELS"} --no-build-isolation --no-deps -e .
status=0
timeout 300 python -m pytest -q tests/test_cuda.py tests/test_gpu_layout.py --junitxml "$OUT/tests.xml" \
  2>&1 | tee "$OUT/tests.txt" || status=$?
timeout 240 python -m flexpage.cli bench latency --device cuda --lengths 128 512 2048 --new-tokens 32 --repeats 2 \
  --configs flexpage flexpage_engine stock_dynamic_sdpa stock_static_compiled --out "$OUT" \
  2>&1 | tail -20 | tee "$OUT/latency.txt" || status=$?
timeout 240 python -m flexpage.cli bench throughput --device cuda --requests 32 --batch-sizes 8 16 32 --out "$OUT" \
  2>&1 | tail -20 | tee "$OUT/throughput.txt" || status=$?
echo "results in $OUT (exit status $status)"
exit $status
