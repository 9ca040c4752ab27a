"""``flexpage serve``: a real uvicorn server on 127.0.0.1 (ephemeral port), driven by the official
``openai`` client; outputs checked against the same model's stock ``generate()``."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
import uvicorn

import flexpage
from flexpage import zoo
from flexpage.serve import build_app
from flexpage.serve.cli import serve
from http_helpers import (ENGINE_OPTIONS, fetch, fetch_response, free_socket, prompt_ids, running_server, served_model,
                          wait_until)
from reference import stock_adjusted, stock_greedy

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

MODEL = "llama-tiny"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def served():
    with served_model(MODEL, max_waiting=64) as served:
        yield served


def test_greedy_completion_matches_stock(served, stock_llama):
    ids = prompt_ids(40)
    expected = stock_greedy(stock_llama, ids, 24)
    out = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    (choice,) = out.choices
    assert choice.text == served.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == 2 else "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (40, len(expected))
    assert out.usage.total_tokens == 40 + len(expected) and out.object == "text_completion"


def test_sixteen_concurrent_requests_equal_one_at_a_time_and_stock(served, stock_llama):
    texts = [f"request {i}: " + "paged attention " * (i % 5) + "héllo, 世界"[: i % 9] for i in range(16)]

    async def all_at_once():  # the client closes on the loop it ran on
        async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            calls = [client.completions.create(model=MODEL, prompt=t, max_tokens=10, temperature=0) for t in texts]
            return await asyncio.gather(*calls)

    together = [out.choices[0].text for out in asyncio.run(all_at_once())]
    alone = [served.client.completions.create(model=MODEL, prompt=t, max_tokens=10, temperature=0).choices[0].text
             for t in texts]
    expected = [served.tokenizer.decode(stock_greedy(stock_llama, served.tokenizer(t)["input_ids"], 10),
                                        skip_special_tokens=True) for t in texts]
    assert together == alone == expected
    # a list of prompts in one call: one choice per prompt, in order
    many = served.client.completions.create(model=MODEL, prompt=texts[:3], max_tokens=10, temperature=0)
    assert [c.text for c in many.choices] == expected[:3] and [c.index for c in many.choices] == [0, 1, 2]


def test_seeded_samples_are_indexed_and_reproducible(served):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=123, n=3,
                  extra_body={"ignore_eos": True, "top_k": 50})
    first, again = (served.client.completions.create(**kwargs) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # three different samples


def test_stream_equals_non_stream_with_one_finish_reason_per_choice(served):
    kwargs = dict(model=MODEL, prompt=prompt_ids(30, seed=1), max_tokens=20, temperature=0.9, top_p=0.95,
                  seed=7, n=2, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kwargs)
    texts, reasons = ["", ""], [[], []]
    chunks = served.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                reasons[c.index].append(c.finish_reason)
    assert texts == [c.text for c in whole.choices]
    assert reasons == [["length"], ["length"]]  # ignore_eos: every sample runs to max_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 40


def test_chat_streaming_role_first_and_usage(served):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    whole = served.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                  temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert whole.usage.prompt_tokens == len(served.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_stop_string_never_appears_even_while_streaming(served):
    ids = prompt_ids(25, seed=3)
    full = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    cut = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                           extra_body={"ignore_eos": True}, stop=[stop, "never-appears"]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = [c.choices[0].text for c in served.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}, stop=stop, stream=True)]
    assert "".join(streamed) == cut.text
    assert not any(stop[:2] in s for s in streamed[:-1]) or stop[:2] in cut.text


def test_logprobs_match_stock_log_softmax(served, stock_llama):
    ids = prompt_ids(20, seed=4)
    out = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    ref = stock_llama.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                               eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens = ref.sequences[0, len(ids):].tolist()
    expected = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(ref.logits, tokens)]
    got = out.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(expected, abs=1e-4)
    for top, lp in zip(got.top_logprobs, expected):  # keyed by token text: ids that decode alike share a key
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy took the best
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_completion_tokens=4, temperature=0, logprobs=True,
                                                 top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)


def test_the_apis_semantics_nulls_stop_token_ids_sampled_logprobs_and_json_bodies(served, stock_llama):
    """What OpenAI and vLLM clients rely on: a null option is its default; vLLM's ``stop_token_ids``
    end an output at the token (kept); completions' ``top_logprobs`` hold the sampled token at every
    position; a body sent as text or a form is refused (a browser sends those cross-site unasked)."""
    ids = prompt_ids(12, seed=7)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "ignore_eos": True}

    def completion(**fields) -> dict:
        status, text = fetch(served.base, "POST", "/v1/completions", json.dumps(body | fields).encode())
        assert status == 200, text
        return json.loads(text)

    nulls = dict.fromkeys(("top_p", "top_k", "n", "stream", "stop", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "logprobs", "echo", "min_tokens", "logit_bias", "user"))
    assert completion(temperature=0, **nulls)["choices"][0]["text"] == completion(temperature=0)["choices"][0]["text"]
    assert (completion(temperature=None, seed=5)["choices"][0]["text"]
            == completion(temperature=1.0, seed=5)["choices"][0]["text"])
    tokens = stock_greedy(stock_llama, ids, 6)
    at = next(j for j in range(1, 6) if tokens[j] not in tokens[:j])  # the first token not seen before it
    stopped = completion(temperature=0, stop_token_ids=[tokens[at]])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == at + 1
    sampled = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=1.8, seed=3,
                                               logprobs=1, extra_body={"ignore_eos": True}).choices[0].logprobs
    for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob)
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        status, text = fetch(served.base, "POST", "/v1/completions", json.dumps(body).encode(),
                             headers={"content-type": media})
        assert status == 415 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_penalties_and_logit_bias_match_stock(served, stock_llama):
    """OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as JSON
    strings) and vLLM's ``repetition_penalty`` reach the engine: the greedy text equals stock
    ``generate()`` with the same processors."""
    ids = prompt_ids(30, seed=6)
    out = served.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, presence_penalty=0.6, frequency_penalty=1.2,
        logit_bias={"17": 5.0, "40": -100}, extra_body={"repetition_penalty": 1.4, "ignore_eos": True})
    expected = stock_adjusted(stock_llama, ids, 12, repetition_penalty=1.4, presence_penalty=0.6,
                              frequency_penalty=1.2, logit_bias={17: 5.0, 40: -100.0})
    assert expected != stock_adjusted(stock_llama, ids, 12)  # the adjustments changed the text
    assert out.choices[0].text == served.tokenizer.decode(expected, skip_special_tokens=True)


def test_prefix_cache_hits_are_reported(served):
    ids = prompt_ids(70, seed=5)
    first = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    again = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64  # 4 full pages; the last token is recomputed
    assert again.choices[0].text == first.choices[0].text
    metrics = fetch(served.base, "GET", "/metrics")[1]
    hits = [line for line in metrics.splitlines() if line.startswith("flexpage:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 64


def test_bad_requests_get_openai_errors_and_change_nothing(served):
    client = served.client
    pages = served.engine.cache.stats().pages_used
    cases = [
        (dict(model="gpt-9", prompt="hi"), "not served here"),
        (dict(model=MODEL, prompt="hi", temperature=5), "temperature"),
        (dict(model=MODEL, prompt=[1, 2, 999]), "outside the vocabulary"),
        (dict(model=MODEL, prompt="hi", max_tokens=5000), "exceeds"),
        (dict(model=MODEL, prompt=""), "empty prompt"),
        (dict(model=MODEL, prompt="hi", frequency_penalty=3), "frequency_penalty"),
        (dict(model=MODEL, prompt="hi", logit_bias={"5": 101}), "logit_bias"),
        (dict(model=MODEL, prompt="hi", logit_bias={"999": 1}), "logit_bias token ids"),
        (dict(model=MODEL, prompt="hi", best_of=3), "best_of"),  # known fields it can't honour: refused
        (dict(model=MODEL, prompt="hi", suffix="end"), "suffix"),
        (dict(model=MODEL, prompt="hi", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens (5) exceeds"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(**kwargs)
        assert message in error.value.body["message"] and error.value.body["type"] == "invalid_request_error"
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs, message, param in [  # structured outputs and tools asked for wrongly
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
         "invalid json_schema: Invalid type: objectx", "response_format"),
        (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "invalid regex", "structured_outputs"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "at most one structured output", None),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "exactly one",
         "structured_outputs"),
        (dict(response_format={"type": "json_schema"}), "json_schema is given with type", "response_format"),
        (dict(response_format={"type": "json_object", "strict": True}), "Extra inputs", "response_format.strict"),
        (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}), "not among the tools", None),
        (dict(tool_choice="required"), "needs tools", None),
        (dict(tools=tools, tool_choice="required", response_format={"type": "json_object"}), "takes no other", None),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "pattern", "tools.0.function.name"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**chat, **kwargs)
        assert message in error.value.body["message"] and error.value.body["param"] == param
    status, body = fetch(served.base, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    # a field the server does not implement is refused naming it, one that asks nothing of the output is not
    for field in ({"not_an_openai_field": 1}, {"min_p": 0.1}, {"guided_whitespace_pattern": " "}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=field)
        assert error.value.body["param"] == next(iter(field)) and "not implement" in error.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"store": False})
    assert len(ok.choices) == 1
    assert served.engine.cache.stats().pages_used == pages == 0


SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 30},
                                          "good": {"type": "boolean"}},
          "required": ["kind", "age", "good"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def chat_ids(tokenizer, messages, **options):
    """The token ids of the chat template's prompt (as the server tokenises it)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_structured_outputs_are_valid_and_greedy_ones_are_stocks(served, stock_llama):
    """Every output valid for its schema — greedy, sampled with n > 1, streamed — and a greedy one
    is stock ``generate()``'s held to the same grammar; the openai client's ``parse`` works."""
    from pydantic import BaseModel
    from typing import Literal

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int
        good: bool

    client, messages = served.client, [{"role": "user", "content": "describe a pet"}]
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Pet, temperature=0,
                                           max_tokens=64)
    (choice,) = parsed.choices
    assert isinstance(choice.message.parsed, Pet) and choice.finish_reason == "stop"
    prompt = chat_ids(served.tokenizer, messages)
    grammar = flexpage.Grammars(served.tokenizer, 256).compile("json_schema", Pet.model_json_schema() | {"additionalProperties": False})  # as parse() sends it
    eos = stock_llama.generation_config.eos_token_id
    stock = stock_llama.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0,
                                 logits_processor=[flexpage.GrammarLogitsProcessor(grammar, eos)])
    assert choice.message.content == served.tokenizer.decode(stock[0, len(prompt):], skip_special_tokens=True)
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    sampled = client.chat.completions.create(model=MODEL, messages=messages, response_format=form, n=3, seed=1,
                                             temperature=1.3, max_tokens=64)
    assert len({c.message.content for c in sampled.choices}) > 1
    streamed = client.chat.completions.create(model=MODEL, messages=messages, response_format=form, seed=2,
                                              max_tokens=64, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    for content in [c.message.content for c in sampled.choices] + [text]:
        jsonschema.validate(json.loads(content), SCHEMA)
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")  # random weights rarely close their first key
    # vLLM's fields, on completions too
    for extra, check in [({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
                         ({"guided_choice": ["red", "green"]}, "red|green"),
                         ({"structured_outputs": {"grammar": 'start: "(" /[a-c]/+ ")"'}}, r"\([a-c]+\)")]:
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=24, n=2, seed=3, extra_body=extra)
        assert all(re.fullmatch(check, c.text) and c.finish_reason == "stop" for c in out.choices)
    cut = client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"guided_json": SCHEMA})
    assert cut.choices[0].finish_reason == "length"  # the grammar could not end within max_tokens
    assert served.engine.cache.stats().pages_used == 0


def test_tool_calls_round_trip_as_openai_clients_expect(served):
    """A forced call (required, named) always parses, streamed as one; its answer goes back as a tool
    message; with tool_choice auto the output is read for calls and the tools reach the template."""
    client = served.client
    messages = [{"role": "user", "content": "the weather in Oslo?"}]
    tools = [WEATHER, TIME]
    for choice_option in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice_option,
                                             parallel_tool_calls=False, temperature=0, max_tokens=160)
        (choice,) = out.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
        if choice_option != "required":
            assert call.function.name == "get_weather"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice_option,
                                              parallel_tool_calls=False, temperature=0, max_tokens=160, stream=True)
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    deltas = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
    many = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                          n=4, seed=0, temperature=1.0, max_tokens=120)
    for c in many.choices:  # sampled, with parallel calls allowed: every complete call parses
        for sampled in c.message.tool_calls or []:
            spec = next(t["function"] for t in tools if t["function"]["name"] == sampled.function.name)
            jsonschema.validate(json.loads(sampled.function.arguments), spec["parameters"])
    # tool_choice auto reads calls out of the text: a regex makes this model write one
    written = re.escape('Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    for stream in (False, True):
        auto = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=120,
                                              stream=stream, extra_body={"structured_outputs": {"regex": written}})
        if stream:
            chunks = [chunk.choices[0] for chunk in auto if chunk.choices]
            content = "".join(c.delta.content or "" for c in chunks)
            calls, reason = [call for c in chunks for call in c.delta.tool_calls or []], chunks[-1].finish_reason
        else:
            content, calls = auto.choices[0].message.content, auto.choices[0].message.tool_calls
            reason = auto.choices[0].finish_reason
        assert (content, reason) == ("Sure. ", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
    # the round trip: the call and the tool's answer go back; the model answers in text
    history = messages + [out.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    told = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert told.choices[0].message.content == answer.choices[0].message.content  # the same prompt, read as text
    rendered = chat_ids(served.tokenizer, [
        {"role": m["role"], "content": m.get("content") or "",
         **({"tool_calls": [{"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
            if m.get("tool_calls") else {})} for m in history], tools=tools)
    assert answer.usage.prompt_tokens == len(rendered)  # the call, the answer and the tools were all in the prompt
    assert '<tool_call>{"name": "get_weather"' in served.tokenizer.decode(rendered)


def test_tool_call_reader_finds_calls_in_text_as_it_grows():
    from flexpage.serve.protocol import Tool
    from flexpage.serve.tools import ToolCallReader

    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>\n'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}</tool_call>')
    for size in (1, 3, 7, len(text)):  # fed in pieces of any size
        reader = ToolCallReader([Tool.model_validate(WEATHER), Tool.model_validate(TIME)])
        content, calls = "", []
        for start in range(0, len(text), size):
            piece, found = reader.feed(text[start:start + size], final=start + size >= len(text))
            content, calls = content + piece, calls + found
        assert content == 'Let me check. <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    reader = ToolCallReader([Tool.model_validate(WEATHER)])
    assert reader.feed("no calls <tool_", final=False) == ("no calls ", [])  # a possible start is held back
    assert reader.feed("x", final=True) == ("<tool_x", [])


def test_429_only_when_the_waiting_room_is_full_now_and_400_for_a_call_that_never_fits(served):
    host, port = served.base.removeprefix("http://").split(":")
    served.server.runner.max_waiting = 2
    connections = []
    try:  # a call with more prompts than the waiting room: 400 even on an idle server
        with pytest.raises(openai.BadRequestError) as error:
            served.client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
        assert error.value.body["code"] == "too_many_prompts" and "--max-waiting" in error.value.body["message"]
        for i in range(12):  # sent at once: 8 may run, 2 may wait, the rest find the waiting room full
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
            connection.request("POST", "/v1/completions", headers={"content-type": "application/json"}, body=json.dumps(
                {"model": MODEL, "prompt": prompt_ids(20, seed=i), "max_tokens": 1500, "ignore_eos": True,
                 "stream": True}))
            connections.append(connection)
        responses = [connection.getresponse() for connection in connections]
        refused = [r for r in responses if r.status == 429]
        assert refused and all(r.status == 200 for r in responses if r not in refused)
        assert 2 <= len(responses) - len(refused) <= 2 + 8  # the waiting room, and those admitted since
        assert refused[0].getheader("Retry-After") == "1"
        assert json.loads(refused[0].read())["error"]["code"] == "queue_full"
    finally:
        for connection in connections:
            connection.close()
        served.server.runner.max_waiting = 64
    wait_until(lambda: served.server.runner.in_flight == 0 and not served.engine.has_work)
    assert served.engine.cache.stats().pages_used == 0
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_a_flood_of_disconnecting_clients_leaves_nothing_behind(served):
    host, port = served.base.removeprefix("http://").split(":")
    before = served.engine.stats().tokens_generated
    connections = []
    for i in range(12):
        body = {"model": MODEL, "prompt": prompt_ids(40 + 10 * i, seed=i), "max_tokens": 1500, "temperature": 0,
                "stream": i % 2 == 0, "ignore_eos": True}
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"content-type": "application/json"})
        connections.append(connection)
    for i, connection in enumerate(connections):
        if i % 2 == 0:  # streaming clients read their first event, then go away
            response = connection.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data:")
        connection.close()  # non-streaming clients go away without waiting for an answer
    wait_until(lambda: not served.engine.has_work and served.server.runner.in_flight == 0)
    assert served.engine.cache.stats().pages_used == 0
    assert served.engine.stats().tokens_generated - before < 12 * 1500  # aborted: none ran to its end
    metrics = fetch(served.base, "GET", "/metrics")[1]
    for gauge in ("flexpage:num_requests_running", "flexpage:num_requests_waiting"):
        assert float(next(line for line in metrics.splitlines() if line.startswith(gauge)).split()[-1]) == 0
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_failed_step_fails_its_requests_and_the_server_goes_on(served, monkeypatch):
    """The model's forward fails in a request's first step (its prompt: an eager step; the
    decode steps after it run their compiled graphs, not the instance's ``forward``)."""
    real, calls = served.engine.model.forward, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(served.engine.model, "forward", fails_once)
    with pytest.raises(openai.InternalServerError) as error:
        served.client.completions.create(model=MODEL, prompt=prompt_ids(10), max_tokens=8, temperature=0)
    assert "device lost" in error.value.body["message"]
    calls.clear()  # streamed: the failure arrives as an error event, then [DONE]
    status, body = fetch(served.base, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompt_ids(10), "max_tokens": 8, "temperature": 0, "stream": True}).encode())
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and "device lost" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    assert served.engine.cache.stats().pages_used == 0
    assert fetch(served.base, "GET", "/health")[0] == 200
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_models_health_and_metrics(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert fetch(served.base, "GET", "/health")[0] == 200
    text = fetch(served.base, "GET", "/metrics")[1]
    for name in ("flexpage:num_requests_running", "flexpage:num_requests_waiting", "flexpage:kv_cache_usage_perc",
                 "flexpage:prefix_cache_queries_total", "flexpage:num_preemptions_total",
                 "flexpage:prompt_tokens_total", "flexpage:generation_tokens_total",
                 "flexpage:time_to_first_token_seconds_bucket", "flexpage:inter_token_latency_seconds_bucket",
                 "flexpage:e2e_request_latency_seconds_count", "flexpage:request_success_total"):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("flexpage:generation_tokens_total")]
    assert float(generated[0].split()[-1]) > 0


def test_readme_and_guide_client_examples_run_as_written(served):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    here = served.base.removeprefix("http://")
    (curl,) = [block for block in re.findall(r"```bash\n(.*?)```", readme, re.S) if block.startswith("curl")]
    done = subprocess.run(curl.replace("127.0.0.1:8000", here), shell=True, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout)["choices"][0]["finish_reason"] in ("stop", "length")
    (client,) = re.findall(r"```python openai-client\n(.*?)```", readme, re.S)
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "serving.md").read_text()
    for where, block in [("README.md", client)] + [("serving guide", b) for b in re.findall(
            r"```python openai-client\n(.*?)```", guide, re.S)]:
        # as a script runs it: without this module's ``from __future__ import annotations``
        exec(compile(block.replace("127.0.0.1:8000", here), f"{where} openai client", "exec", dont_inherit=True), {})


def test_serve_steps_the_engine_on_the_calling_thread_and_stops_on_sigint(stock_llama):
    """``flexpage serve``'s loop: HTTP on a helper thread, every engine step on the caller's thread
    (on CPU the one that built the model: a second OpenMP team slows every op); SIGINT stops both
    gracefully and the previous signal handlers come back."""
    engine = flexpage.Engine(zoo.build(MODEL), **ENGINE_OPTIONS)
    stepped_on = set()
    step = engine.step
    engine.step = lambda: stepped_on.add(threading.current_thread()) or step()
    app = build_app(engine, zoo.load_tokenizer(MODEL), MODEL, engine_thread=False)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # uvicorn binds it next
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    ids, answers = prompt_ids(20, seed=5), []

    def client() -> None:
        try:
            wait_until(lambda: server.started, 60)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
            answers.append(client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0))
        finally:
            signal.raise_signal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=client, daemon=True).start()
    assert serve(server, app.state.server.runner)
    assert stepped_on == {threading.current_thread()}
    assert answers[0].choices[0].text == zoo.load_tokenizer(MODEL).decode(stock_greedy(stock_llama, ids, 8),
                                                                          skip_special_tokens=True)
    assert signal.getsignal(signal.SIGINT) is before and not engine.scheduler.has_work


def test_flexpage_serve_command(tmp_path):
    """The console command serves a save_pretrained directory with its own tokenizer (without packed
    weights: stock's tokens still), with the operator's options: the API key from
    ``FLEXPAGE_API_KEY``, a body limit, CORS for one origin, n-gram speculation (stock's tokens,
    streamed or not; its drafts counted in the metrics); stopped by the test."""
    model_dir = tmp_path / "model"
    zoo.build(MODEL).save_pretrained(model_dir)
    zoo.load_tokenizer(MODEL).save_pretrained(model_dir)
    command = [str(BIN / "flexpage"), "serve", str(model_dir), "--served-model-name", "mine", "--max-cached-tokens",
               "2048", "--max-batch-size", "8", "--max-tokens-per-step", "128", "--no-pack-weights",
               "--max-request-bytes", "4096", "--allowed-origins", "http://ui.test", "--shutdown-timeout", "5",
               "--speculative", "ngram", "--num-speculative-tokens", "3"]
    with running_server(command, env=os.environ | {"FLEXPAGE_API_KEY": "sesame"}) as base:
        assert fetch(base, "GET", "/v1/models")[0] == 401
        status, text = fetch(base, "POST", "/v1/completions", b" " * 5000, headers={"Authorization": "Bearer sesame"})
        assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"
        status, headers, _ = fetch_response(base, "OPTIONS", "/v1/models", headers={
            "Origin": "http://ui.test", "Access-Control-Request-Method": "GET"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://ui.test"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0, timeout=60)
        out = client.completions.create(model="mine", prompt="Hello", max_tokens=4, temperature=0)
        expected = stock_greedy(zoo.build(MODEL), zoo.load_tokenizer(MODEL)("Hello")["input_ids"], 4)
        assert out.choices[0].text == zoo.load_tokenizer(MODEL).decode(expected, skip_special_tokens=True)
        assert client.models.list().data[0].id == "mine"
        tokenizer = zoo.load_tokenizer(MODEL)
        ids = prompt_ids(12) * 3  # prompt lookup finds the prompt's own repeats
        expected = tokenizer.decode(stock_greedy(zoo.build(MODEL), ids, 24), skip_special_tokens=True)
        assert client.completions.create(model="mine", prompt=ids, max_tokens=24, temperature=0).choices[0].text == expected
        stream = client.completions.create(model="mine", prompt=ids, max_tokens=24, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
        metrics = fetch(base, "GET", "/metrics")[1]
        drafted = re.search(r'flexpage:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)', metrics)
        assert drafted and float(drafted.group(1)) > 0
