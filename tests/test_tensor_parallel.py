"""Tensor parallelism (transformers' TP, 2 CPU ranks over gloo): per-rank pools hold half the KV
heads; wrap and the Engine give every rank the same tokens, equal to single-process stock."""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from http_helpers import running_server

import flexpage
from flexpage import UnsupportedModelError, zoo

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    zoo.build("llama-tiny").save_pretrained(root / "model")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    # --standalone: a rendezvous on a free loopback port
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(root / "model"), str(root)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


def stock_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_each_rank_holds_half_the_kv_heads(ranks):
    config = zoo.load_config("llama-tiny")
    for r in ranks:
        assert r["pool_shape"][1] == config.num_key_value_heads // 2


def test_wrap_under_tp_matches_stock_tp_and_single_process(ranks):
    stock = zoo.build("llama-tiny")
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    single = stock.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0).tolist()
    for r in ranks:
        assert r["wrap"] == r["wrap_stock_tp"] == single


def test_engine_ranks_agree_and_match_stock(ranks):
    leader, follower = ranks
    assert leader["engine"] == follower["engine"]  # every rank took the same steps and samples
    assert leader["preemptions"] > 0 and leader["prefix_hit_tokens"] > 0
    assert leader["pages_used_after"] == follower["pages_used_after"] == 0
    stock = zoo.build("llama-tiny")
    for prompt, n, out in zip(leader["prompts"], (30, 12, 25, 40, 8, 20), leader["engine"]):
        assert out == stock_greedy(stock, prompt, n)
    seeded = leader["engine"][6:10]
    assert all(len(s) == 12 for s in seeded) and seeded[0] != seeded[1]


def test_flexpage_serve_under_torchrun(tmp_path):
    """Rank 0 serves HTTP, rank 1 follows its steps; the answer equals single-process stock."""
    zoo.build("llama-tiny").save_pretrained(tmp_path / "model")
    tokenizer = zoo.load_tokenizer("llama-tiny")
    tokenizer.save_pretrained(tmp_path / "model")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "flexpage.cli", "serve", str(tmp_path / "model"), "--tp-size", "2", "--max-cached-tokens", "256",
               "--max-batch-size", "4", "--max-tokens-per-step", "64"]  # the worker's engine: its compiled shapes
    with running_server(command, env=dict(os.environ, OMP_NUM_THREADS="1")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "Tensor parallel"
        outs = [client.completions.create(model=str(tmp_path / "model"), prompt=prompt, max_tokens=6, temperature=0)
                for _ in range(2)]
        expected = stock_greedy(zoo.build("llama-tiny"), tokenizer(prompt)["input_ids"], 6)
        assert [o.choices[0].text for o in outs] == [tokenizer.decode(expected, skip_special_tokens=True)] * 2


def test_kv_heads_that_do_not_split_are_refused():
    model = zoo.build("llama-tiny")
    model._tp_size = 3  # what transformers sets (read through model.tp_size) on a tensor-parallel model
    with pytest.raises(UnsupportedModelError, match="do not split evenly over tensor-parallel size 3"):
        flexpage.wrap(model)
    assert "generate" not in vars(model)


def test_quick_tp_benchmark(tmp_path):
    subprocess.run([sys.executable, "-m", "flexpage.cli", "bench", "tp", "--quick", "--out", str(tmp_path)], check=True,
                   timeout=900)
    one, two = json.loads((tmp_path / "tp.json").read_text())["records"]
    assert (one["tp"], two["tp"]) == (1, 2) and one["kv_heads_per_rank"] == 2 * two["kv_heads_per_rank"]
    assert one["kv_bytes_per_token_per_rank"] == 2 * two["kv_bytes_per_token_per_rank"]
    assert one["decode_ms_per_token"] > 0 and two["decode_ms_per_token"] > 0
