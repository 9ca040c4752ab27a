"""The ``flexpage-bench`` console script and ``--model`` taking a local save_pretrained directory."""

import json
import subprocess
import sys
from pathlib import Path

import models

BIN = Path(sys.executable).parent


def test_console_script_lists_commands_and_rejects_unknown_ones():
    done = subprocess.run([str(BIN / "flexpage-bench"), "nonsense"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "flexpage-bench latency" in done.stderr


def test_prefix_benchmark_on_a_local_model_directory(tmp_path):
    """bench_prefix --quick on a model saved to disk: caching halves the pages and changes no token."""
    model_dir = tmp_path / "model"
    models.build("llama-tiny").save_pretrained(model_dir)
    out = tmp_path / "out"
    subprocess.run([str(BIN / "flexpage-bench"), "prefix", "--quick", "--model", str(model_dir), "--out", str(out)],
                   check=True, timeout=900)
    data = json.loads((out / "prefix.json").read_text())
    assert data["meta"]["model"] == str(model_dir) and not data["meta"]["errors"]
    rows = {(r["scenario"], r["config"]): r for r in data["records"]}
    for scenario in ("system_prompt", "document_qa"):
        cached = rows[scenario, "flexpage_prefix_caching"]
        plain = rows[scenario, "flexpage_no_prefix_caching"]
        assert cached["outputs_equal_without_caching"]
        assert cached["prefix_hit_tokens"] > 0 and plain["prefix_hit_tokens"] == 0
        assert cached["peak_pages"] < plain["peak_pages"]
        assert {"stock_padded_b4", "stock_continuous_batching"} <= {c for s, c in rows if s == scenario}
    assert (out / "prefix.png").stat().st_size > 0
