"""flexpage.wrap: generate() through the paged cache gives the stock model's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import flexpage
from flexpage import zoo
from flexpage import OutOfPagesError, PagedKVCache, UnsupportedModelError
from flexpage import hf as flexpage_hf

PROMPT_LENGTHS = (5, 37, 130)  # longer than the tiny sliding windows (32)
VOCAB = 256


def prompts(lengths=PROMPT_LENGTHS, seed=0):
    """Left-padded token ids and attention mask, as a tokenizer with padding_side='left' gives."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.fixture
def paged_calls(monkeypatch):
    """Counts calls of flexpage's one attention dispatch (a packed step's attention over pages), to
    prove the paged path ran."""
    calls = []
    real = flexpage_hf.packed_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(flexpage_hf, "packed_attention", counting)
    return calls


def greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("arch", zoo.ARCHITECTURES)
def test_greedy_generate_matches_stock(arch, paged_calls):
    stock = zoo.build(f"{arch}-tiny")
    paged = flexpage.wrap(zoo.build(f"{arch}-tiny"), page_size=16, max_cached_tokens=2048)
    ids, mask = prompts()
    forwards = 0
    for rows in ([1], [0, 1, 2]):  # one 37-token prompt alone, then the left-padded batch
        width = max(PROMPT_LENGTHS[r] for r in rows)
        batch_ids, batch_mask = ids[rows, -width:], mask[rows, -width:]
        expected = greedy(stock, batch_ids, batch_mask, max_new_tokens=40)
        got = greedy(paged, batch_ids, batch_mask, max_new_tokens=40)
        assert torch.equal(got, expected)
        forwards += got.shape[1] - width  # one forward per generated token
    assert len(paged_calls) == forwards * paged.config.num_hidden_layers  # every layer ran paged
    assert flexpage.paged_state(paged).cache.stats().pages_used == 0  # pages released when generate returns


def test_sampling_eos_and_max_new_tokens_match_stock(paged_calls):
    stock = zoo.build("llama-tiny")
    paged = flexpage.wrap(zoo.build("llama-tiny"))
    assert flexpage.paged_state(paged).cache.page_size == 64  # the default on CPU: larger KV blocks (16 elsewhere)
    assert flexpage.paged_state(flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=32)).cache.page_size == 16  # 2 pages
    ids, mask = prompts()
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = stock.generate(ids, attention_mask=mask, do_sample=True, top_k=20, temperature=0.9,
                                  max_new_tokens=24, pad_token_id=0)
        torch.manual_seed(seed)
        got = paged.generate(ids, attention_mask=mask, do_sample=True, top_k=20, temperature=0.9,
                             max_new_tokens=24, pad_token_id=0)
        assert torch.equal(got, expected)
    free_run = greedy(stock, ids, mask, max_new_tokens=30)
    eos = int(free_run[0, ids.shape[1] + 6])  # a token row 0 produces mid-way
    expected = greedy(stock, ids, mask, max_new_tokens=30, eos_token_id=eos)
    got = greedy(paged, ids, mask, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(got, expected) and got.shape[1] < free_run.shape[1] or (got[:, -1] == 0).any()
    assert greedy(paged, ids, mask, max_new_tokens=7).shape[1] == ids.shape[1] + 7
    assert paged_calls


def test_saved_and_reloaded_model(tmp_path):
    zoo.build("qwen2-tiny", seed=3).save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    paged = flexpage.wrap(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    ids, mask = prompts((12, 30))
    assert torch.equal(greedy(paged, ids, mask, max_new_tokens=20), greedy(stock, ids, mask, max_new_tokens=20))


# every name the installed transformers takes a cache under (``cache`` from 5.24 on)
@pytest.mark.parametrize("alias", sorted({"past_key_values", flexpage_hf.cache_argument(LlamaForCausalLM)}))
def test_explicit_cache_holds_exactly_the_live_tokens(alias):
    model = flexpage.wrap(zoo.build("llama-tiny"))
    stock = zoo.build("llama-tiny")
    cache = PagedKVCache(model.config, page_size=16, num_pages=64, max_batch_size=4)
    ids, mask = prompts()
    new = 12
    out = greedy(model, ids, mask, max_new_tokens=new, **{alias: cache})
    assert torch.equal(out, greedy(stock, ids, mask, max_new_tokens=new))
    stats = cache.stats()
    # the prompts' real tokens and every generated token but the last (never fed back); no padding
    assert stats.live_tokens == sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * (new - 1)
    assert stats.pages_used == sum(-(-(n + new - 1) // 16) for n in PROMPT_LENGTHS)


def test_manual_loop_with_explicit_cache_derives_positions_from_it(stock_llama):
    """transformers' Cache contract: a forward given no ``position_ids`` continues at the cached
    length. A prompt fed in two chunks, then token by token, gives DynamicCache's logits."""
    from transformers import DynamicCache

    model = flexpage.wrap(zoo.build("llama-tiny"))
    name = flexpage_hf.cache_argument(model)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(3))
    paged, reference = PagedKVCache(model.config, page_size=16, num_pages=8, max_batch_size=2), DynamicCache()
    for start, end in ((0, 8), (8, 12), (12, 13), (13, 14)):
        with torch.no_grad():
            expected = stock_llama(ids[:, start:end], **{name: reference}).logits
            got = model(ids[:, start:end], **{name: paged}).logits
        assert torch.allclose(got, expected, atol=1e-4), (start, (got - expected).abs().max())
    assert paged.get_seq_length() == reference.get_seq_length() == 14


def test_left_padded_batch_runs_packed_and_comes_back_as_a_batch(stock_llama):
    """A direct forward of a left-padded batch on a PagedKVCache runs as one packed row (padding
    dropped) and comes back as ``[batch, columns]``: the real positions' logits and hidden states
    are stock's (DynamicCache, the same padding mask and positions), the padding positions' zeros;
    the decode step after it gets its positions from the cache."""
    from transformers import DynamicCache

    model = flexpage.wrap(zoo.build("llama-tiny"))
    name = flexpage_hf.cache_argument(model)
    ids, mask = prompts((9, 5))
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    paged, reference = PagedKVCache(model.config, page_size=16, num_pages=8, max_batch_size=2), DynamicCache()
    with torch.no_grad():
        expected = stock_llama(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                               **{name: reference})
        got = model(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True, **{name: paged})
    real = mask.bool()
    assert got.logits.shape == expected.logits.shape and len(got.hidden_states) == len(expected.hidden_states)
    assert torch.allclose(got.logits[real], expected.logits[real], atol=1e-4)
    assert torch.allclose(got.hidden_states[-1][real], expected.hidden_states[-1][real], atol=1e-4)
    assert (got.logits[~real] == 0).all() and all((hidden[~real] == 0).all() for hidden in got.hidden_states)
    step, longer = torch.tensor([[5], [7]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        expected = stock_llama(step, attention_mask=longer, position_ids=positions[:, -1:] + 1, **{name: reference})
        got = model(step, attention_mask=longer, **{name: paged})
    assert torch.allclose(got.logits, expected.logits, atol=1e-4)
    assert [paged.seq_length(row) for row in paged.batch_rows] == [10, 6]  # the padding never stored


def test_out_of_pages_raises_before_overwriting_and_next_call_succeeds():
    stock = zoo.build("llama-tiny")
    model = flexpage.wrap(zoo.build("llama-tiny"))
    cache = PagedKVCache(model.config, page_size=16, num_pages=4, max_batch_size=2)  # 64 tokens
    ids, mask = prompts((60,))
    with pytest.raises(OutOfPagesError):
        greedy(model, ids, mask, max_new_tokens=10, **{flexpage_hf.cache_argument(model): cache})
    # the cache holds tokens 0..63 exactly as the stock model computed them: nothing overwritten
    reference = stock(torch.cat([ids, greedy(stock, ids, mask, max_new_tokens=4)[:, 60:]], 1), use_cache=True)
    reference_cache = getattr(reference, flexpage_hf.cache_argument(stock))  # the output field has the argument's name
    row = cache.batch_rows[0]
    for layer in range(model.config.num_hidden_layers):
        keys, values = cache.gather(layer, row)
        assert keys.shape[1] == 64
        assert torch.allclose(keys, reference_cache.layers[layer].keys[0], atol=1e-4)
        assert torch.allclose(values, reference_cache.layers[layer].values[0], atol=1e-4)
    # through wrap: the failing call raises, releases its pages, and a fitting call then works
    small = flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=64)
    with pytest.raises(OutOfPagesError):
        greedy(small, ids, mask, max_new_tokens=10)
    assert flexpage.paged_state(small).cache.stats().pages_used == 0
    ids2, mask2 = prompts((20,))
    assert torch.equal(greedy(small, ids2, mask2, max_new_tokens=10), greedy(stock, ids2, mask2, max_new_tokens=10))


def test_no_recompiles_for_2048_token_prompt_and_64_decode_steps():
    from flexpage.bench.measure import compiled_graphs

    model = flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=4096)
    ids, mask = prompts((2048,))
    first = greedy(model, ids, mask, max_new_tokens=64, min_new_tokens=64)  # warm-up: compiles prefill + decode
    graphs = compiled_graphs()
    ids2, mask2 = prompts((2048,), seed=1)
    greedy(model, ids2, mask2, max_new_tokens=64, min_new_tokens=64)
    assert compiled_graphs() == graphs
    assert first.shape[1] == 2048 + 64


def test_bfloat16_agrees_with_float32_stock():
    """bf16 paged decoding, teacher-forced on float32 stock's greedy tokens, predicts the same next token
    at >= 95% of positions (free-running bf16 would compound a single early flip into every later token)."""
    stock = zoo.build("llama-tiny")
    paged = flexpage.wrap(zoo.build("llama-tiny", dtype=torch.bfloat16))
    cache = PagedKVCache(paged.config, page_size=16, num_pages=64, max_batch_size=4, dtype=torch.bfloat16)
    ids, mask = prompts()
    new = 40
    expected = greedy(stock, ids, mask, max_new_tokens=new, min_new_tokens=new)[:, ids.shape[1]:]
    predicted = []
    step_ids, step_mask = ids, mask
    with torch.no_grad():
        for i in range(new):
            positions = (step_mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]  # as generate() does
            logits = paged(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, **{flexpage_hf.cache_argument(paged): cache}).logits[:, -1]
            predicted.append(logits.argmax(-1))
            step_ids = expected[:, i : i + 1]
            step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], 1)
    agreement = (torch.stack(predicted, 1) == expected).float().mean().item()
    assert cache.layers[0].keys.dtype == torch.bfloat16
    assert cache.stats().live_tokens == sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * (new - 1)
    assert agreement >= 0.95


def test_plain_forward_while_wrapped_and_unwrap_restore_stock():
    stock = zoo.build("gemma2-tiny")
    model = flexpage.wrap(zoo.build("gemma2-tiny"))
    ids, mask = prompts((40, 40))
    expected = stock(ids, labels=ids)
    got = model(ids, labels=ids)  # scoring while wrapped: no paged cache, the stock path
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)
    greedy(model, ids, mask, max_new_tokens=3)
    assert torch.equal(model(ids, labels=ids).loss, expected.loss)
    flexpage.unwrap(model)
    assert model.config._attn_implementation == stock.config._attn_implementation
    assert "generate" not in vars(model) and "prepare_inputs_for_generation" not in vars(model)
    assert not model.base_model._forward_pre_hooks
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=5), greedy(stock, ids, mask, max_new_tokens=5))


def test_cache_is_reused_and_released_over_100_calls():
    model = flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=1024)
    cache = flexpage.paged_state(model).cache
    pointers = [layer.keys.data_ptr() for layer in cache.layers]
    ids, mask = prompts((9, 3))
    for _ in range(100):
        greedy(model, ids, mask, max_new_tokens=3)
        stats = cache.stats()
        assert stats.pages_used == 0 and stats.live_tokens == 0 and cache.batch_rows == []
    assert flexpage.paged_state(model).cache is cache and [layer.keys.data_ptr() for layer in cache.layers] == pointers


def test_device_map_keeps_each_layers_pools_on_its_device():
    from accelerate import dispatch_model

    stock = zoo.build("llama-tiny")
    model = zoo.build("llama-tiny")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = flexpage.wrap(dispatch_model(model, device_map=device_map))
    for i, layer in enumerate(flexpage.paged_state(model).cache.layers):
        assert layer.keys.device == model.model.layers[i].self_attn.q_proj.weight.device
    ids, mask = prompts((7, 20))
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=8), greedy(stock, ids, mask, max_new_tokens=8))


def test_layers_offloaded_to_cpu_and_disk_get_pools_where_they_run(tmp_path):
    """accelerate's offloading: a layer on disk has ``meta`` parameters; its pools belong on its
    hook's execution device (here the CPU), and generate() gives stock's tokens."""
    from transformers import AutoModelForCausalLM

    stock = zoo.build("llama-tiny")
    stock.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    model = flexpage.wrap(model)
    assert [layer.keys.device.type for layer in flexpage.paged_state(model).cache.layers] == ["cpu", "cpu"]
    ids, mask = prompts((7, 20))
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=8), greedy(stock, ids, mask, max_new_tokens=8))


def test_unsupported_models_raise_naming_model_and_reason():
    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="T5ForConditionalGeneration.*encoder-decoder"):
        flexpage.wrap(t5)
    chunked = zoo.build("llama-tiny")
    chunked.config.attention_chunk_size = 64
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*attention_chunk_size"):
        flexpage.wrap(chunked)
    flex = zoo.build("llama-tiny", attn_implementation="flex_attention")
    with pytest.raises(UnsupportedModelError, match="'flex_attention'"):
        flexpage.wrap(flex)
    assert flex.config._attn_implementation == "flex_attention" and "generate" not in vars(flex)


def test_right_padding_is_rejected_and_leaves_cache_empty():
    model = flexpage.wrap(zoo.build("llama-tiny"))
    ids, mask = prompts((5, 9))
    with pytest.raises(ValueError, match="left padding"):
        greedy(model, ids.flip(1), mask.flip(1), max_new_tokens=2)
    assert flexpage.paged_state(model).cache.stats().pages_used == 0


def test_beam_search_and_multiple_return_sequences_match_stock():
    stock = zoo.build("llama-tiny")
    paged = flexpage.wrap(zoo.build("llama-tiny"))
    ids, mask = prompts((9, 21))
    kwargs = dict(num_beams=4, num_return_sequences=3, max_new_tokens=12, early_stopping=True)
    assert torch.equal(greedy(paged, ids, mask, **kwargs), greedy(stock, ids, mask, **kwargs))


def test_cache_crop_select_and_repeat_keep_pages_consistent():
    model = flexpage.wrap(zoo.build("llama-tiny"))
    cache = PagedKVCache(model.config, page_size=16, num_pages=32, max_batch_size=8)
    ids, mask = prompts((5, 20))
    greedy(model, ids, mask, max_new_tokens=6, min_new_tokens=6, **{flexpage_hf.cache_argument(model): cache})
    lengths = [cache.seq_length(r) for r in cache.batch_rows]
    assert lengths == [5 + 5, 20 + 5] and cache.get_seq_length() == 20 + 5
    keys_before = cache.gather(0, cache.batch_rows[1])[0]
    cache.crop(-3)
    assert [cache.seq_length(r) for r in cache.batch_rows] == [7, 22] and cache.get_seq_length() == 22
    assert torch.equal(cache.gather(0, cache.batch_rows[1])[0], keys_before[:, :22])
    cache.batch_select_indices(torch.tensor([1]))
    assert len(cache.batch_rows) == 1 and cache.stats().pages_used == 2  # 22 tokens, 16-token pages
    cache.batch_repeat_interleave(3)
    assert len(cache.batch_rows) == 3 and cache.stats().pages_used == 2  # forks share the pages
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.stats().pages_used == 2 and cache.stats().live_tokens == 22
    cache.reset()
    assert cache.stats().pages_used == 0 and cache.batch_rows == [] and cache.get_seq_length() == 0


def test_compiled_decode_matches_stock_without_recompiles():
    from flexpage.bench.measure import compiled_graphs

    stock = zoo.build("llama-tiny")
    model = flexpage.wrap(zoo.build("llama-tiny"), compile_decode=True)
    ids, mask = prompts((20, 37))
    expected = greedy(stock, ids, mask, max_new_tokens=30)
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=30), expected)  # warm-up: compiles
    graphs = compiled_graphs()
    ids2, mask2 = prompts((3, 50), seed=4)
    assert torch.equal(greedy(model, ids2, mask2, max_new_tokens=30), greedy(stock, ids2, mask2, max_new_tokens=30))
    assert compiled_graphs() == graphs  # a new prompt length reuses the decode graph (prefill bucket 64 too)
    steps = flexpage.paged_state(model).steps
    assert steps.steps >= 2 * 29 and steps.buckets >= {1, 2}  # every decode step but the first ran compiled
    # a manual loop over the wrapped cache: its one-token forwards run the compiled step too, at stock's logits
    from transformers import DynamicCache

    cache, reference, name = flexpage.paged_state(model).cache, DynamicCache(), flexpage_hf.cache_argument(model)
    cache.reset()
    before, token = steps.steps, ids2[:, -20:]  # two rows: the decode bucket generate compiled
    with torch.no_grad():
        for _ in range(6):
            expected = stock(token, **{name: reference}).logits
            got = model(input_ids=token, **{name: cache}).logits
            assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
            token = expected[:, -1:].argmax(-1)
    assert steps.steps == before + 5 and compiled_graphs() == graphs  # the prompt eager, each token compiled
    flexpage.unwrap(model)
    assert "forward" not in vars(model)  # the class's forward shows through again


def test_a_compiled_wrap_of_a_windowed_model_learns_its_window_when_wrapped():
    """``wrap(compile_decode=True)`` learns the window of a model whose every layer attends one with
    the layers' attention variants, before any forward: a cache whose steps are all compiled (K/V
    written directly, as ``bench long`` fills a long context) gives back the pages behind the
    window too. Only the eager steps taught it before."""
    model = zoo.build("mistral-tiny")
    window = model.config.sliding_window
    cache = flexpage.paged_state(flexpage.wrap(model, compile_decode=True)).cache
    assert window and cache.page_table.window == window
    eager = flexpage.paged_state(flexpage.wrap(zoo.build("mistral-tiny"))).cache
    assert eager.page_table.window is None  # eager steps: learned from the first one


def repetitive_prompt() -> torch.Tensor:
    """A prompt that repeats itself, so prompt lookup finds drafts."""
    base = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    return torch.cat([base, base, base[:, :5]], 1)


@pytest.mark.parametrize("assistant", ["prompt_lookup", "same_weights", "other_weights"])
def test_assisted_generation_matches_stock(assistant, monkeypatch):
    """Assisted generate() (prompt lookup; a wrapped assistant on its own paged cache, agreeing or
    not) gives stock assisted generation's tokens, which are stock greedy's; drafts that agree
    save forwards of the main model, and rejected ones are cropped from both caches."""
    stock, paged = zoo.build("llama-tiny"), flexpage.wrap(zoo.build("llama-tiny"))
    ids = repetitive_prompt()
    if assistant == "prompt_lookup":
        stock_kw = paged_kw = {"prompt_lookup_num_tokens": 3}
    else:
        seed = 0 if assistant == "same_weights" else 1
        stock_kw = {"assistant_model": zoo.build("llama-tiny", seed=seed)}
        paged_kw = {"assistant_model": flexpage.wrap(zoo.build("llama-tiny", seed=seed))}
    plain = stock.generate(ids, max_new_tokens=30, do_sample=False)
    forwards = {"stock": 0, "paged": 0}
    for name, model in (("stock", stock), ("paged", paged)):
        model.register_forward_pre_hook(lambda module, args, name=name: forwards.__setitem__(name, forwards[name] + 1))
    expected = stock.generate(ids, max_new_tokens=30, do_sample=False, **stock_kw)
    got = paged.generate(ids, max_new_tokens=30, do_sample=False, **paged_kw)
    assert torch.equal(got, expected) and torch.equal(got, plain)
    assert forwards["paged"] == forwards["stock"]  # the same drafts accepted
    if assistant == "same_weights":
        assert forwards["paged"] < 30  # every draft accepted: fewer forwards than tokens
    assert flexpage.paged_state(paged).cache.stats().pages_used == 0
    if "assistant_model" in paged_kw:  # the assistant's cache was threaded through its drafts: it holds them
        assert flexpage.paged_state(paged_kw["assistant_model"]).cache.stats().live_tokens >= ids.shape[1]


def test_a_cache_handed_back_by_generate_continues_and_resets_on_the_next_call():
    """With ``return_dict_in_generate`` the output's cache is the model's, still holding the
    tokens (to continue from, as stock's); the next generate without a cache starts afresh."""
    model = flexpage.wrap(zoo.build("llama-tiny"))
    ids, mask = prompts((9,))
    out = greedy(model, ids, mask, max_new_tokens=5, return_dict_in_generate=True)
    cache = flexpage.paged_state(model).cache
    assert out.cache is cache and cache.stats().live_tokens == 9 + 4  # the last token's K/V are not computed yet
    greedy(model, ids, mask, max_new_tokens=5)
    assert cache.stats().pages_used == 0
