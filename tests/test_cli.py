"""The ``flexpage`` command: subcommands, help, errors, a local model directory, and the scripts as files."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexpage import cli, zoo
from flexpage.bench.measure import add_run_arguments, out_dir
from notebook_runner import run_notebook

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_console_script_help_and_unknown_commands():
    done = subprocess.run([str(BIN / "flexpage"), "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0
    for line in ("flexpage generate", *(f"flexpage bench {name}" for name in cli.BENCHMARKS)):
        assert line in done.stdout
    done = subprocess.run([str(BIN / "flexpage"), "nonsense"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "unknown command 'nonsense'" in done.stderr
    assert cli.main([]) == 2 and cli.main(["bench"]) == 2 and cli.main(["bench", "nonsense"]) == 2


@pytest.mark.parametrize("command", [["generate"], *(["bench", name] for name in cli.BENCHMARKS)])
def test_each_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flexpage {' '.join(command)}")
    assert ("--out" in out and "--quick" in out) if command[0] == "bench" else "--model" in out


def test_script_file_runs_its_subcommand():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_latency.py"), "--help"], capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.startswith("usage: flexpage bench latency")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_gpu_check_on_a_machine_without_a_gpu_says_so():
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(Path.home())}  # this environment's python first
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    assert done.returncode == 2
    assert "no CUDA GPU visible" in done.stderr and "Traceback" not in done.stderr + done.stdout


def test_prefix_benchmark_on_a_local_model_directory_and_its_notebook(tmp_path, monkeypatch):
    """bench prefix --quick on a model saved to disk: caching halves the pages and changes no token."""
    model_dir = tmp_path / "model"
    zoo.build("llama-tiny").save_pretrained(model_dir)
    out = tmp_path / "out"
    subprocess.run([str(BIN / "flexpage"), "bench", "prefix", "--quick", "--model", str(model_dir), "--out", str(out)],
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
    assert run_notebook("prefix_sharing", out, monkeypatch) == 1


def test_attention_notebook_runs_the_quick_benchmark(tmp_path, monkeypatch):
    assert run_notebook("paged_attention", tmp_path, monkeypatch) == 1
    records = json.loads((tmp_path / "bench_attention.json").read_text())["records"]
    assert {r["config"] for r in records} == {"paged", "paged_small_pages", "mask_build", "sdpa_contiguous",
                                              "flex_contiguous", "flex_contiguous_blocks"}
    assert all(r["max_abs_err_vs_sdpa"] < 1e-4 for r in records if r["config"] == "paged")
    assert all(r["median_ms"] > 0 for r in records)


def test_quick_mode_never_writes_into_results(tmp_path):
    """Without --out, a quick run goes to a new temporary directory, not over the committed figures."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, "a trial", default="results/trial")
    quick = out_dir(parser.parse_args(["--quick"]))
    shutil.rmtree(quick)
    assert Path(quick).parent != ROOT and "flexpage-quick-" in quick
    assert out_dir(parser.parse_args(["--quick", "--out", str(tmp_path)])) == str(tmp_path)
    assert parser.parse_args([]).default_out == "results/trial"


@pytest.mark.parametrize("flag, expected", [([], None), (["--compile-decode"], True), (["--no-compile-decode"], False)])
def test_serve_compile_decode_reaches_the_engine(flag, expected, monkeypatch):
    """``flexpage serve --compile-decode`` is the Engine's ``compile_decode``, the same word and meaning."""
    from flexpage.serve import cli as serve_cli

    class Built(Exception):
        pass

    def engine(model, **options):
        raise Built(options)

    monkeypatch.setattr(serve_cli, "Engine", engine)
    monkeypatch.setattr(serve_cli.zoo, "load", lambda name, **options: None)
    with pytest.raises(Built) as built:
        serve_cli.main(["llama-tiny", *flag])
    assert built.value.args[0]["compile_decode"] is expected
