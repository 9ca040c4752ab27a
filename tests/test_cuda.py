"""The same code path on a CUDA GPU (skipped where there is none): paged attention against a
float64 reference, wrap's greedy identity, the Engine's mixed workload, no recompiles after warm-up,
compiled decode steps replayed as CUDA graphs, sampling against transformers' warpers.
``scripts/gpu_check.sh`` runs these with the benchmarks on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from attention_cases import run_case
from reference import assert_draws_follow_the_warpers

import flexpage
from flexpage import zoo
from flexpage.engine import sampling
from flexpage.bench.measure import compiled_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # TF32 and half-precision kernels
LENGTHS = {  # (contexts, new tokens) per row: lengths of 1, page-size multiples and not
    "decode": ([40, 1, 133], [1, 1, 1]),
    "prefill": ([0, 0, 0], [150, 1, 17]),
    "chunked": ([17, 64, 0], [40, 3, 16]),
}
CASES = [(mode, page, mod, dtype, hq, hkv)
         for mode in ("decode", "prefill", "chunked")
         for page, mod in ((16, "causal"), (32, "sliding"), (64, "softcap"), (16, "alibi"), (16, "prefix_lm"))
         for dtype in (torch.float32, torch.float16, torch.bfloat16)
         for hq, hkv in ((8, 2),)] + [("decode", 16, "causal", torch.float16, 4, 4), ("decode", 16, "causal",
                                                                                     torch.float16, 8, 1)]


@pytest.mark.parametrize("mode, page_size, mod, dtype, hq, hkv", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_paged_attention_matches_reference_on_cuda(mode, page_size, mod, dtype, hq, hkv):
    contexts, news = LENGTHS[mode]
    for seed in (0, 1):  # two placements of the pages in a shuffled pool
        for out, ref in run_case(mode, page_size, mod, dtype, hq, hkv, contexts, news, seed, device="cuda"):
            assert torch.isfinite(out).all()
            assert (out - ref).abs().max().item() <= TOLERANCE[dtype]


def greedy(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_wrap_greedy_matches_stock_on_cuda(arch):
    ids = torch.randint(3, 256, (3, 40), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    mask[2, :7] = 0
    stock = zoo.build(f"{arch}-tiny").cuda()
    paged = flexpage.wrap(zoo.build(f"{arch}-tiny").cuda(), max_cached_tokens=4096)
    assert torch.equal(greedy(paged, ids, mask, 24), greedy(stock, ids, mask, 24))
    assert all(layer.keys.is_cuda for layer in flexpage.paged_state(paged).cache.layers)
    assert flexpage.paged_state(paged).cache.page_size == 16  # the default off the CPU: FlexAttention's smallest CUDA tile


def test_compiled_decode_matches_stock_on_cuda():
    """``wrap(compile_decode=True)`` on a GPU: greedy tokens equal stock's, and new prompt
    lengths compile nothing (the one decode graph serves every context length)."""
    stock = zoo.build("llama-tiny").cuda()
    paged = flexpage.wrap(zoo.build("llama-tiny").cuda(), max_cached_tokens=4096, compile_decode=True)
    g = torch.Generator().manual_seed(2)
    for round_, length in enumerate((40, 37, 50)):  # one prefill bucket (64), as on the CPU
        ids = torch.randint(3, 256, (2, length), generator=g).cuda()
        mask = torch.ones_like(ids)
        mask[1, : length // 3] = 0
        assert torch.equal(greedy(paged, ids, mask, 20), greedy(stock, ids, mask, 20))
        if round_ == 0:
            graphs = compiled_graphs()
    assert compiled_graphs() == graphs
    assert flexpage.paged_state(paged).steps.recorded > 0  # its decode steps replay CUDA graphs


def test_engine_decode_steps_replay_cuda_graphs_on_cuda():
    """The Engine's compiled decode steps on a GPU: warm-up records every bucket as a CUDA graph
    (``step_graph.CudaGraphs``), decode steps replay them, and the tokens are stock's."""
    engine = flexpage.Engine(zoo.build("llama-tiny").cuda(), max_cached_tokens=2048, max_batch_size=4,
                             compile_decode=True)
    steps = engine.runner.graphs
    assert len(steps.buckets) > 1 and steps.recorded == len(steps.buckets)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 40, 23, 71, 5)]
    new_tokens = [24, 16, 30, 8, 20]
    outputs = engine.generate(prompts, max_new_tokens=new_tokens)
    stock = zoo.build("llama-tiny").cuda()
    for prompt, n, out in zip(prompts, new_tokens, outputs):
        assert out == greedy(stock, torch.tensor([prompt]).cuda(), None, n)[0, len(prompt):].tolist()
    assert engine.stats().compiled_steps > 0 and steps.recorded == len(steps.buckets)


def test_engine_mixed_workload_on_cuda():
    """Preemption (a small pool), prefix hits (a shared prefix), every request equal to stock;
    then unseen lengths compile nothing."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 90, 17, 60, 3, 130, 9)]
    new_tokens = [30, 12, 25, 40, 8, 20, 16, 33]
    engine = flexpage.Engine(zoo.build("llama-tiny").cuda(), max_cached_tokens=256, max_batch_size=4,
                             max_tokens_per_step=64)
    outputs = engine.generate(prompts, max_new_tokens=new_tokens)
    stock = zoo.build("llama-tiny").cuda()
    for prompt, n, out in zip(prompts, new_tokens, outputs):
        expected = greedy(stock, torch.tensor([prompt]).cuda(), None, n)[0, len(prompt):]
        assert out == expected.tolist()
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and engine.cache.stats().pages_used == 0
    graphs = compiled_graphs()
    engine.generate([torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 77, 111, 2)],
                    max_new_tokens=[9, 21, 5, 14])
    assert compiled_graphs() == graphs


def test_structured_outputs_match_stock_held_to_the_grammar_on_cuda():
    """The Engine's constrained greedy tokens on a GPU (the grammar's masks applied by torch on the
    device) equal stock ``generate()`` held to the same grammar by the logits processor."""
    tokenizer = zoo.load_tokenizer("llama-tiny")
    engine = flexpage.Engine(zoo.build("llama-tiny").cuda(), tokenizer=tokenizer, max_cached_tokens=1024,
                             max_batch_size=4)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    grammar = engine.grammar("json_schema", schema)
    stock = zoo.build("llama-tiny").cuda()
    eos = stock.generation_config.eos_token_id
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 17)]
    for prompt, out in zip(prompts, engine.generate(prompts, max_new_tokens=24, grammar=grammar)):
        processor = flexpage.GrammarLogitsProcessor(grammar, eos)
        expected = stock.generate(torch.tensor([prompt]).cuda(), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                  eos_token_id=eos, logits_processor=[processor])[0, len(prompt):].tolist()
        assert out == expected[: len(out)] and (len(out) == len(expected) or expected[len(out)] == eos)


@pytest.mark.parametrize("tries", [4, 0])  # top-p by rejection; from the exact nucleus (a radix select)
def test_sampling_follows_the_warpers_on_cuda(tries, monkeypatch):
    monkeypatch.setattr(sampling, "NUCLEUS_TRIES", tries)
    monkeypatch.setattr(sampling, "FIRST_WIDTH", 3 if tries == 0 else sampling.FIRST_WIDTH)
    assert_draws_follow_the_warpers("cuda")
