"""The latency benchmark's quick mode and the notebook that draws it run end to end (not timed)."""

import json
import math
import os

import pytest

from notebook_runner import run_notebook

from flexpage import zoo
from flexpage.bench import latency

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

CONFIGS = set(latency.CONFIGS)  # every configuration the benchmark offers is run and recorded
COLUMNS = {"ttft_ms", "decode_ms_per_token", "e2e_ms", "peak_mem_mb", "recompiles", "kv_live_bytes",
           "kv_reserved_bytes", "warmup_s"}


def test_notebook_runs_quick_benchmark_and_draws_it(tmp_path, monkeypatch):
    assert run_notebook("latency_vs_length", tmp_path, monkeypatch) == 3

    data = json.loads((tmp_path / "latency.json").read_text())
    records = data["records"]
    assert {r["config"] for r in records} == CONFIGS
    assert {r["length"] for r in records} == {64, 256}
    for r in records:
        assert COLUMNS <= r.keys(), r
        assert all(math.isfinite(r[c]) for c in COLUMNS), r
    flexpage_rows = [r for r in records if r["config"].startswith("flexpage")]
    assert all(r["recompiles"] == 0 and r["kv_reserved_bytes"] >= r["kv_live_bytes"] for r in flexpage_rows)
    for suffix in ("csv", "json", "e2e_ms.png", "decode_ms_per_token.png", "peak_mem_mb.png"):
        assert any(p.name.endswith(suffix) for p in tmp_path.iterdir()), suffix
    assert os.path.getsize(tmp_path / "latency.csv") > 0


def test_a_subset_of_configurations_led_by_the_engine_over_a_padded_batch(tmp_path):
    """``--configs`` may leave out every wrapped model: the Engine leads the records. A batch
    holds prompts of mixed lengths (left-padded for stock, one request each for the Engine);
    ``--sample top-p`` makes both sample with top-p."""
    from flexpage.bench import latency

    latency.main(["--quick", "--batch", "2", "--sample", "top-p", "--configs", "flexpage_engine", "stock_dynamic_sdpa",
                  "--out", str(tmp_path), "--name", "subset"])
    data = json.loads((tmp_path / "subset.json").read_text())
    records = data["records"]
    assert data["meta"]["sampling"] == latency.SAMPLING["top-p"]  # the run records how every configuration drew
    assert [r["config"] for r in records] == ["flexpage_engine", "stock_dynamic_sdpa"] * 2  # lengths 64, 256
    assert [r["prompt_tokens"] for r in records] == [64 + 48] * 2 + [256 + 192] * 2  # rows of L and 3L/4 tokens
    engine = [r for r in records if r["config"] == "flexpage_engine"]
    assert all(r["kv_reserved_bytes"] >= r["kv_live_bytes"] > 0 and r["recompiles"] == 0 for r in engine)
    assert all(r["host_ms_per_step"] > 0 for r in engine)  # the Engine's host work is measured, stock has none
    assert not any("host_ms_per_step" in r for r in records if r["config"] == "stock_dynamic_sdpa")
    assert [r["kv_live_bytes"] for r in engine] == [  # the real tokens only, as the pages hold them
        (n + 2 * 7) * latency.kv_bytes_per_token(zoo.load("llama-tiny").config, 4) for n in (112, 448)]
