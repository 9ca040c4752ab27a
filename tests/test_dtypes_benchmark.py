"""The dtypes benchmark's quick mode end to end (not timed): every cell measured, its ratios taken
within rounds, the CPU's tier recorded beside the figures."""

import json
import math

import pytest

from flexpage.bench import dtypes
from flexpage.core import cpu


@pytest.mark.slow  # a benchmark
def test_quick_dtypes_benchmark(tmp_path):
    dtypes.main(["--quick", "--configs", "stock", "engine", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "dtypes.json").read_text())
    summary = data["meta"]["summary"]
    assert {(r["dtype"], r["config"]) for r in summary} == {(d, c) for d in dtypes.DTYPES for c in ("stock", "engine")}
    for row in summary:
        for field in ("decode_ms", "prefill_ms"):
            assert math.isfinite(row[field]) and row[field] > 0
            assert row[f"{field}_x_stock"] > 0 and row[f"{field}_x_float32"] > 0
        if row["config"] == "stock":
            assert row["decode_ms_x_stock"] == row["prefill_ms_x_stock"] == 1.0
    assert data["meta"]["machine"]["cpu_tier"] == cpu.tier()
    assert len(data["records"]) == 4 and (tmp_path / "dtypes.png").stat().st_size > 0
