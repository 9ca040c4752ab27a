"""The speculative-decoding benchmark's quick mode: every k and alpha measured, tokens checked in
the run, the notebook drawing its figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from notebook_runner import run_notebook

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

ROOT = Path(__file__).resolve().parents[1]


def test_quick_speculative_benchmark_and_notebook(tmp_path, monkeypatch):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speculative.py"), "--quick", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=900)  # it asserts that speculation changed no token
    records = json.loads((tmp_path / "speculative.json").read_text())["records"]
    verify = {(r["batch"], r["length"], r["k"]) for r in records if r["measure"] == "verify"}
    assert verify == {(b, n, k) for b in (1, 4) for n in (64, 128) for k in (0, 2, 4)}
    accept = {(r["batch"], r["config"], r["alpha"]): r for r in records if r["measure"] == "acceptance"}
    for batch in (1, 4):
        for config in ("fixed", "adaptive"):
            assert accept[batch, config, 1.0]["acceptance_rate"] == 1.0
            assert accept[batch, config, 1.0]["tokens_per_verification"] > 1
            assert accept[batch, config, 0.0]["acceptance_rate"] == 0.0
    assert {r["config"] for r in records if r["measure"] == "assisted"} == {
        f"{side} {path}" for side in ("stock", "wrap") for path in ("plain", "prompt lookup", "assistant")
    } | {"engine plain", "engine ngram"}
    assert (tmp_path / "speculative.png").stat().st_size > 0
    assert run_notebook("speculative", tmp_path, monkeypatch) == 1
