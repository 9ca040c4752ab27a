"""The start-up benchmark's quick mode runs fresh processes, cold then warm (not timed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

ROOT = Path(__file__).resolve().parents[1]


def test_quick_startup_benchmark(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_startup.py"), "--quick", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=900)
    records = json.loads((tmp_path / "startup.json").read_text())["records"]
    assert [(r["config"], r["start"]) for r in records] == [("stock", "cold"), ("stock", "warm"), ("wrap", "cold"),
                                                            ("wrap", "warm")]
    for r in records:
        assert 0 < r["first_token_s"] < r["total_s"] and r["engine_warmup_s"] == 0
