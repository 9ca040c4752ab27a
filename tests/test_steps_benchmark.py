"""The decode-step benchmark's quick mode runs end to end and records both configurations (not timed)."""

import json
import math

import pytest

from flexpage.bench import steps

pytestmark = pytest.mark.slow  # benchmarks


def test_quick_steps_benchmark(tmp_path):
    steps.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "steps.json").read_text())
    assert {(r["rows"], r["config"]) for r in data["records"]} == {(n, c) for n in (1, 2) for c in steps.CONFIGS}
    assert all(math.isfinite(r["ms_per_step"]) and r["ms_per_step"] > 0 for r in data["records"])
    assert {r["rows"] for r in data["meta"]["summary"]} == {1, 2}
    assert (tmp_path / "steps.png").stat().st_size > 0 and (tmp_path / "steps.csv").exists()
