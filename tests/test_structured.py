"""Structured outputs: an Engine's constrained greedy tokens equal stock ``generate()`` held to the
same grammar by a logits processor; every output, greedy or sampled, with ``n`` > 1 and with
speculative decoding, is valid for its schema as ``jsonschema`` judges it (regexes as ``re`` does)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import LogitsProcessorList

import flexpage
from flexpage import GrammarLogitsProcessor, Grammars, InvalidRequestError, zoo
from flexpage.engine.structured import allowed_tokens, greedy_allowed
from reference import make_engine, workload

SCHEMA = {  # short enough that a random-weight model completes it within the token budget
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer():
    return zoo.load_tokenizer("llama-tiny")


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_engine(tokenizer=tokenizer, speculative="ngram")


def text(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=True)


def stock_constrained(model, prompt, grammar, eos, **options):
    processor = GrammarLogitsProcessor(grammar, eos)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=eos,
                         logits_processor=LogitsProcessorList([processor]), **options)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_stock_held_to_the_same_grammar(stock_llama, engine, tokenizer):
    grammar = engine.grammar("json_schema", SCHEMA)
    eos = stock_llama.generation_config.eos_token_id
    prompts = workload((5, 40, 17))
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, grammar=grammar)
    # the Engine ends an output where its grammar can take no more tokens; stock goes on to its
    # only allowed token, a stop token
    assert [o + [eos] for o in outputs] == [stock_constrained(stock_llama, p, grammar, eos, do_sample=False)
                                            for p in prompts]
    for tokens in outputs:
        jsonschema.validate(json.loads(text(tokenizer, tokens)), SCHEMA)
    # the unconstrained model writes no JSON at all
    free = engine.generate(prompts[:1], max_new_tokens=NEW_TOKENS)[0]
    with pytest.raises(ValueError):
        json.loads(text(tokenizer, free))


def test_every_sampled_output_is_valid_with_n_and_speculation(engine, tokenizer):
    grammar = engine.grammar("json_schema", SCHEMA)
    engine.reset_stats()
    prompts = workload((9, 60), seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=True, seed=i,
                                                            temperature=1.5, num_return_sequences=3, grammar=grammar))
    outputs, reasons = {}, {}
    for record in engine.run():
        outputs.setdefault(record.index, []).append(record.token)
        reasons[record.index] = record.finish_reason
    assert len(outputs) == 6 and len({tuple(o) for o in outputs.values()}) > 1  # samples differ
    for index, tokens in outputs.items():
        jsonschema.validate(json.loads(text(tokenizer, tokens)), SCHEMA)
        assert reasons[index] == "stop"  # the grammar's end, or a stop token after it
    assert engine.stats().drafted_tokens > 0  # n-gram drafts were verified against the grammar
    assert engine.cache.stats().pages_used == 0


def test_regex_choice_and_lark(engine, tokenizer):
    prompts = workload((7, 30), seed=5)
    for tokens in engine.generate(prompts, max_new_tokens=12, grammar=engine.grammar("regex", r"[0-9]{3}-[a-z]{2}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(tokenizer, tokens))
    choices = ["yes", "no", "maybe not"]
    for tokens in engine.generate(prompts, max_new_tokens=12, do_sample=True, seed=0,
                                  grammar=engine.grammar("choice", choices)):
        assert text(tokenizer, tokens) in choices
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    for tokens in engine.generate(prompts, max_new_tokens=30, grammar=engine.grammar("grammar", lark)):
        assert re.fullmatch(r"\([a-c](,[a-c])*\)", text(tokenizer, tokens))


def test_a_grammar_unfinished_at_max_tokens_ends_with_length(engine):
    grammar = engine.grammar("json_schema", SCHEMA)
    engine.add_request(workload((5,))[0], flexpage.SamplingParams(max_new_tokens=4, grammar=grammar))
    records = [r for r in engine.run()]
    assert len(records) == 4 and records[-1].finish_reason == "length"


def test_invalid_grammars_are_refused_naming_the_kind(engine):
    pages = engine.cache.stats().pages_used
    for kind, spec, words in [("json_schema", {"type": "objectx"}, "objectx"), ("regex", "a(b", "unclosed"),
                              ("choice", [], "non-empty"), ("grammar", "start: foo", "unknown name"), ("yaml", "x", "unknown")]:
        with pytest.raises(InvalidRequestError, match=f"(?s)invalid {kind}: .*{words}"):
            engine.grammar(kind, spec)
    assert engine.cache.stats().pages_used == pages and not engine.has_work
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        flexpage.Engine(zoo.build("llama-tiny"), max_cached_tokens=256, max_batch_size=2, warmup=False).grammar(
            "json_object")


def test_grammars_are_cached_per_spec(tokenizer):
    grammars = Grammars(tokenizer, 256)
    first = grammars.compile("json_schema", SCHEMA)
    assert grammars.compile("json_schema", json.loads(json.dumps(SCHEMA))) is first
    assert grammars.compile("json_object") is not first


def test_constraint_allows_stop_tokens_only_where_the_grammar_may_end(tokenizer):
    grammar = Grammars(tokenizer, 256).compile("choice", ["ab", "abab"])
    constraint = grammar.constraint({2, 7})
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    assert constraint.allowed()[a] and not constraint.allowed()[[b, 2, 7]].any()
    constraint.take(a)
    constraint.take(b)  # "ab": complete, or "abab" goes on
    allowed = constraint.allowed()
    assert allowed[[a, 2, 7]].all() and allowed.sum() == 3
    constraint.take(a)
    constraint.take(b)
    assert constraint.ended_at == 4  # nothing can follow "abab"
    assert constraint.valid_prefix([a]) == 0


def test_accepts_agrees_with_the_mask_at_every_token(tokenizer):
    """``accepts`` (the greedy pick's shortcut) says of each token what ``allowed`` says, at every
    state of a JSON schema's output, where stop tokens may and may not come."""
    grammar = Grammars(tokenizer, 256).compile("json_schema", SCHEMA)
    constraint, probe = grammar.constraint({2, 9}), grammar.constraint({2, 9})
    for token in tokenizer('{"color":"red","n":7,"ok":true}', add_special_tokens=False)["input_ids"]:
        checked = [probe.accepts(t) for t in range(-1, 258)]  # one token at a time, no mask computed
        allowed = constraint.allowed()
        assert [constraint.accepts(t) for t in range(-1, 258)] == checked == [False] + allowed.tolist() + [False] * 2
        constraint.take(token)
        probe.take(token)


def states(tokenizer, grammar, texts):
    """A constraint (stop tokens 2 and 9) at the end of each of ``texts``."""
    constraints = []
    for prefix in texts:
        constraint = grammar.constraint({2, 9})
        for token in tokenizer(prefix, add_special_tokens=False)["input_ids"]:
            constraint.take(token)
        constraints.append(constraint)
    return constraints


PREFIXES = ['{"color":"', '{"color":"red","n":', '{"color":"red","n":7', '{"color":"red","n":7,"ok":',
            '{"color":"red","n":7,"ok":true}']  # each with two allowed tokens or more


def test_greedy_allowed_is_the_argmax_of_the_masked_logits(tokenizer):
    """The greedy pick under grammars equals torch's argmax of the logits with each disallowed token
    at -inf: the lowest id among equal best tokens, never a padded LM head's extra entries, stop
    tokens only where the grammar may end (at the last prefix nothing else may come)."""
    constraints = states(tokenizer, Grammars(tokenizer, 256).compile("json_schema", SCHEMA), PREFIXES)
    allowed = torch.from_numpy(allowed_tokens(constraints))
    torch.manual_seed(0)
    logits = torch.randn(7, 260)  # two rows no constraint reads; four entries past the vocabulary
    rows = [6, 0, 3, 2, 5]
    logits[:, 256:] = 50.0
    for k, row in enumerate(rows):
        ids = allowed[k].nonzero().flatten()
        logits[row, ids[-2:]] = 20.0  # a tie between the two highest allowed ids
        logits[row, (~allowed[k]).nonzero().flatten()[0]] = 30.0  # a better token the grammar refuses
    expected = torch.where(allowed, logits[rows, :256], float("-inf")).argmax(1).tolist()
    assert greedy_allowed(logits, rows, constraints) == expected
    assert greedy_allowed(logits.bfloat16(), rows, constraints) == expected  # the model's dtype, picked in float32
    assert expected[-1] in (2, 9) and all(t not in (2, 9) for t in expected[:-1])
    assert [allowed[k].nonzero().flatten()[-2].item() for k in range(5)] == expected  # the lower of the tie


def test_json_object_takes_any_object_and_nothing_else(tokenizer):
    grammar = Grammars(tokenizer, 256).compile("json_object")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in ['{"a":[1,{"b":null}],"c":"d"}', "{}"]:
        constraint = grammar.constraint({2})
        for token in encode(text):
            assert constraint.allowed()[token]
            constraint.take(token)
        assert constraint.ended_at == len(encode(text))
    for text in ["[1]", '"a"', "{'a':1}"]:
        assert grammar.constraint({2}).valid_prefix(encode(text)) < len(encode(text))


def test_wrapped_generate_follows_the_processor_as_stock(stock_llama, tokenizer):
    grammar = Grammars(tokenizer, 256).compile("json_schema", SCHEMA)
    eos = stock_llama.generation_config.eos_token_id
    prompt = workload((11,), seed=7)[0]
    model = flexpage.wrap(zoo.build("llama-tiny"), max_cached_tokens=512, max_batch_size=2)
    for options in ({"do_sample": False}, {"do_sample": True, "temperature": 1.5}):
        torch.manual_seed(0)
        expected = stock_constrained(stock_llama, prompt, grammar, eos, **options)
        torch.manual_seed(0)
        assert stock_constrained(model, prompt, grammar, eos, **options) == expected
        jsonschema.validate(json.loads(text(tokenizer, expected)), SCHEMA)


def test_the_serving_guides_engine_example_runs_as_written(capsys):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "serving.md").read_text()
    (block,) = re.findall(r"```python engine\n(.*?)```", guide, re.S)
    exec(compile(block, "serving guide engine example", "exec", dont_inherit=True), {"__name__": "guide_example"})
    number, answer = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", number) and answer in ("yes", "no")
