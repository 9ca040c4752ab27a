"""``flexpage bench serve --quick``: both servers start, take every load point, and nothing fails (not timed),
with sampled completions (the greedy ones are tested against stock in test_serve.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

BIN = Path(sys.executable).parent


def test_quick_serve_benchmark_against_transformers_serve(tmp_path):
    subprocess.run([str(BIN / "flexpage"), "bench", "serve", "--quick", "--temperature", "0.7", "--top-p", "0.9",
                    "--out", str(tmp_path)], check=True, timeout=1200)
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["meta"]["sampling"] == {"temperature": 0.7, "top_p": 0.9}
    rows = data["records"]
    points = {(r["server"], r["mode"], r["value"]) for r in rows}
    assert points == {(s, m, v) for s in ("flexpage", "transformers") for m, v in
                      (("rate", 2.0), ("rate", 8.0), ("concurrency", 4))}, rows
    for r in rows:
        assert r["failures"] == 0 and r["requests"] == 6, r
        for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_the_unpacked_flexpage_server_is_started_without_packed_weights_and_the_json_one_gets_schemas():
    from flexpage.bench.serve import JSON_SCHEMA, request_options, server_command

    args = SimpleNamespace(max_batch_size=8, max_cached_tokens=2048, temperature=0.0, top_p=None)
    unpacked, plain, json_server = (server_command(kind, "dir", 1234, args)
                                    for kind in ("flexpage_unpacked", "flexpage", "flexpage_json"))
    assert unpacked == plain + ["--no-pack-weights"] and "serve" in plain and "dir" in plain and json_server == plain
    assert request_options("flexpage", args) == {"temperature": 0.0}
    assert request_options("flexpage_json", args) == {"temperature": 0.0, "extra_body": {
        "structured_outputs": {"json": JSON_SCHEMA}}}


def test_rounds_are_summarised_by_their_medians():
    from flexpage.bench.serve import medians

    rows = [{"server": "a", "mode": "concurrency", "value": 16, "output_tokens_per_s": tps, "failures": 0,
             "round": r} for r, tps in enumerate((900.0, 1200.0, 1000.0))]
    rows.append({"server": "b", "mode": "concurrency", "value": 16, "output_tokens_per_s": 800.0, "failures": 0,
                 "round": 0})
    summary = {(r["server"], r["value"]): r["output_tokens_per_s"] for r in medians(rows)}
    assert summary == {("a", 16): 1000.0, ("b", 16): 800.0}
