"""The roofline benchmark: what it counts as a step's bytes, and its quick mode end to end (not timed)."""

import json
import math

import pytest
import torch

import flexpage
from flexpage import zoo
from flexpage.bench import roofline


def test_a_step_reads_every_weight_once_and_the_live_kv():
    """Bytes, not timings: an untied embedding table counts not (a step reads one row), a tied one
    once (the LM head reads it whole); the K/V are ``tokens`` slots of every layer's two pools."""
    untied = zoo.build("llama-tiny")
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    params = {p.data_ptr(): p for p in untied.parameters()}
    buffers = sum(b.numel() for b in untied.buffers() if b.is_floating_point())  # rotary frequencies
    expected = sum(p.numel() for p in params.values()) + buffers - untied.get_input_embeddings().weight.numel()
    assert sum(t.numel() for t in roofline.weight_tensors(untied)) == expected
    untied.lm_head.weight = untied.get_input_embeddings().weight  # tie them
    tied = sum(t.numel() for t in roofline.weight_tensors(untied))
    assert tied == expected  # the table replaces the LM head's own weight, counted once
    cache = flexpage.PagedKVCache(untied.config, page_size=16, num_pages=8, max_batch_size=2)
    kv = roofline.kv_tensors(cache, 40)
    per_token = 2 * untied.config.num_hidden_layers * cache.num_kv_heads * cache.head_dim
    assert sum(t.numel() for t in kv) == 40 * per_token
    with pytest.raises(ValueError, match="do not fit"):
        roofline.kv_tensors(cache, 8 * 16 + 1)
    assert roofline.read_ms([torch.ones(1000)]) > 0


@pytest.mark.slow  # a benchmark
def test_quick_roofline_benchmark(tmp_path):
    roofline.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "roofline.json").read_text())
    cells = {(r["batch"], r["config"]) for r in data["meta"]["summary"]}
    assert cells == {(1, c) for c in roofline.BATCH_ONE} | {(2, "engine")}
    for row in data["meta"]["summary"]:
        assert math.isfinite(row["ms"]) and row["ms"] > 0 and row["roofline_ms"] > 0
        assert row["step_bytes"] > 0 and row["x_roofline"] == pytest.approx(row["ms"] / row["roofline_ms"], rel=1e-2)
    assert (tmp_path / "roofline.png").stat().st_size > 0 and (tmp_path / "roofline.csv").exists()
