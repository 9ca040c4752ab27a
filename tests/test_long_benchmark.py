"""The long-context benchmark: its filled contexts are real contexts, and its quick mode end to end (not timed)."""

import json
import math

import pytest
import torch

import flexpage
from flexpage import zoo
from flexpage.bench import long
from flexpage.bench.roofline import as_bytes
from notebook_runner import run_notebook


@pytest.mark.parametrize("name", ["llama-tiny", "gemma2-tiny"])  # Gemma 2: windowed layers in window rows
def test_a_filled_context_decodes_as_stock_over_the_same_kv(name):
    """The benchmark writes a context's K/V straight into the pages: a decode step over them gives
    stock's logits over a dynamic cache holding the same K/V, and the step is appended after them."""
    stock = zoo.build(name)
    model = flexpage.wrap(zoo.build(name), max_cached_tokens=256, max_batch_size=1)
    token = torch.tensor([[7]])
    with torch.inference_mode():
        expected = stock(input_ids=token, cache=long.fill_stock(stock, 100, seed=3)).logits
        cache = long.fill_paged(model, 100, seed=3)
        out = model(input_ids=token, cache=cache).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert cache.seq_length(cache.batch_rows[0]) == 101


def test_teacher_forced_choices_of_a_generation_are_its_tokens():
    """``next_tokens`` reads the greedy choice after each prefix from position 128: over a greedy
    generation of the same model, exactly the generated tokens (positions aligned)."""
    model = flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=512, max_batch_size=1)
    ids = torch.randint(3, 256, (1, 128), generator=torch.Generator().manual_seed(5))
    generated = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0]
    assert torch.equal(long.next_tokens(model, generated), generated[128:])


def test_the_roofline_reads_a_quantised_pools_bytes():
    cache = flexpage.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, num_pages=4,
                                  max_batch_size=1, kv_dtype="int8")
    pool = cache.layers[0].keys[:, :, :40]
    read = as_bytes(pool)
    assert [piece.numel() for piece in read] == [40 * (64 + 2)] * 2  # each head's 40 tokens, scales too
    assert all(piece.is_contiguous() and piece.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
               for piece in read)  # the very bytes a step reads
    weight = torch.randn(3, 5, dtype=torch.bfloat16)
    assert [p.numel() for p in as_bytes(weight)] == [weight.nbytes] and as_bytes(torch.tensor(1.0))[0].numel() == 4


@pytest.mark.slow  # a benchmark and its notebook
def test_quick_long_benchmark_and_its_notebook(tmp_path, monkeypatch):
    long.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "long.json").read_text())
    summary = {(r["config"], r["length"]): r for r in data["meta"]["summary"]}
    configs = ("pages_auto", "pages_int8", "pages_fp8", "window", "groups", "stock")
    assert set(summary) == {(c, n) for c in configs for n in (64, 512)}
    for row in summary.values():
        assert math.isfinite(row["ms"]) and row["ms"] > 0 and row["roofline_ms"] > 0
    assert summary["pages_int8", 512]["kv_mb"] == summary["pages_fp8", 512]["kv_mb"] < summary["pages_auto", 512]["kv_mb"]
    # mistral-tiny attends 32 positions back: at 512 its row holds its window's pages, not 512 tokens'
    assert summary["window", 512]["kv_held_fraction"] < 0.25 and summary["pages_auto", 512]["kv_held_fraction"] == 1
    assert summary["window", 64]["kv_held_fraction"] > summary["window", 512]["kv_held_fraction"]
    # gemma2-tiny: its global layer keeps every page, its windowed layer two pages of 64 at most
    assert 0.5 < summary["groups", 512]["kv_held_fraction"] <= (512 + 128) / 1024
    assert summary["groups", 64]["kv_held_fraction"] == 1
    agreement = json.loads((tmp_path / "long_agreement.json").read_text())["records"]
    assert {r["format"] for r in agreement} == {"int8", "fp8"}
    assert all(0 <= r["agree"] <= 1 and 0 <= r["forced_agree"] <= 1 for r in agreement)
    errors = (tmp_path / "long_attention_error.csv").read_text().splitlines()
    assert len(errors) == 1 + 2 * zoo.load_config("llama-tiny").num_hidden_layers  # a row per format and layer
    assert (tmp_path / "long.png").stat().st_size > 0
    assert run_notebook("long_context", tmp_path, monkeypatch) == 1  # latency and memory against length
