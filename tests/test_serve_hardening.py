"""``flexpage serve`` against careless and hostile clients: every bad request is a 4xx OpenAI error,
no request changes another's output or stops the engine, the event loop keeps answering, the
metrics count every finish, and the operator's options (API key, CORS, shutdown timeout) hold.
Servers bind 127.0.0.1 on ephemeral ports; every load loop is bounded in count and time."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import signal
import threading
import time
from contextlib import ExitStack, contextmanager

import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexpage
from flexpage import zoo
from flexpage.serve import build_app
from flexpage.engine.sampling import Sampler
from flexpage.serve.app import StopStrings
from flexpage.serve.cli import serve
from flexpage.serve.runner import EngineFailedError
from http_helpers import (ENGINE_OPTIONS, app_on_loopback, fetch, fetch_response, free_socket, health_probe,
                          prompt_ids, served_model, wait_until)

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks

MODEL = "llama-tiny"
# /health answers within this whatever else the server does: well under what tokenising a body at the
# size limit on the event loop would take, above the scheduling noise of a small shared machine
HEALTH_SECONDS = 0.25
STALL_SECONDS = 1.0  # a pause this long is a stall, whatever else runs on the machine


@pytest.fixture(scope="module")
def served():
    with served_model(MODEL, max_waiting=16) as served:
        yield served


def post(base: str, path: str, body: dict | bytes, **options) -> tuple[int, dict]:
    status, text = fetch(base, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), **options)
    return status, json.loads(text)


def assert_openai_error(status: int, body: dict, expected_status: int, text: str = "") -> None:
    assert status == expected_status, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert len(error["message"]) <= 1000 and text in error["message"], error


def success_counts(base: str) -> dict[str, float]:
    """``request_success_total`` by reason, and the end-to-end histogram's count under "e2e"."""
    counts = {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 0.0}
    for line in fetch(base, "GET", "/metrics")[1].splitlines():
        if line.startswith("flexpage:request_success_total"):
            counts[line.split('finished_reason="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("flexpage:e2e_request_latency_seconds_count"):
            counts["e2e"] = float(line.split()[-1])
    return counts


def gauge(base: str, name: str) -> float:
    return float(next(line for line in fetch(base, "GET", "/metrics")[1].splitlines()
                      if line.startswith(f"flexpage:{name}")).split()[-1])


def idle(served) -> bool:
    return served.server.runner.in_flight == 0 and not served.engine.has_work


# ---------------------------------------------------------------------------------- stop strings
@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=4),
       st.lists(st.text("abc", max_size=6), max_size=12))
def test_stop_strings_match_a_naive_search_of_the_growing_text(stops, pieces):
    """Fed piece by piece, the matcher reports where the first stop string to complete starts
    (earliest start among those completed by one character) and, until then, the longest end of
    the text that begins a stop string: as a search of the whole text at every character finds."""
    matcher, text = StopStrings(stops), ""
    for piece in pieces:
        found = matcher.feed(piece)
        expected = None
        for end in range(len(text) + 1, len(text + piece) + 1):  # the first character completing a stop
            starts = [end - len(s) for s in stops if (text + piece)[:end].endswith(s)]
            if starts:
                expected = min(starts)
                break
        assert found == expected
        if found is not None:
            return
        text += piece
        assert matcher.partial == max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


# ---------------------------------------------------------------------------------- isolation
def test_hostile_sampling_values_fail_alone_or_are_clamped(served):
    """A seed past int64 and a repetition penalty that would underflow are 400s naming the field; a
    temperature of 1e-300 is raised to 0.01 (with top_k and logprobs, which once killed the engine);
    a greedy stream running beside them is unchanged and the engine serves on."""
    ids = prompt_ids(30, seed=11)
    alone = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    for body, param in [({"seed": 2**70}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
                        ({"repetition_penalty": 1e-300, "temperature": 1}, "repetition_penalty"),
                        ({"repetition_penalty": 1e300}, "repetition_penalty")]:
        status, error = post(served.base, "/v1/completions", {"model": MODEL, "prompt": "hi", **body})
        assert_openai_error(status, error, 400)
        assert error["error"]["param"] == param

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True}, stream=True)
            hostile = [client.completions.create(model=MODEL, prompt=prompt_ids(8, seed=k), max_tokens=12,
                                                 temperature=1e-300, logprobs=5, seed=2**63 - 1 - k,
                                                 extra_body={"top_k": 5, "ignore_eos": True, **extra})
                       for k, extra in enumerate([{}, {"top_k": -1}, {"top_p": 0.5}, {"min_tokens": 3}])]
            stream, *answers = await asyncio.gather(greedy, *hostile)
            return "".join([c.choices[0].text async for c in stream]), answers

    text, answers = asyncio.run(together())
    assert text == alone
    at_floor = served.client.completions.create(model=MODEL, prompt=prompt_ids(8, seed=0), max_tokens=12,
                                                temperature=0.01, logprobs=5, seed=2**63 - 1,
                                                extra_body={"top_k": 5, "ignore_eos": True})
    assert answers[0].choices[0].text == at_floor.choices[0].text  # 1e-300 acts as 0.01
    for answer in answers:
        assert answer.usage.completion_tokens == 12
        assert all(v > -1e4 for v in answer.choices[0].logprobs.token_logprobs)
    assert fetch(served.base, "GET", "/health")[0] == 200
    wait_until(lambda: idle(served))
    assert served.engine.cache.stats().pages_used == 0


def test_a_request_whose_sampling_raises_fails_alone(served, monkeypatch):
    """Anything raising after the forward (here the sampler, for one request's temperature) fails
    that request with a 500 OpenAI error; the step's other requests get their tokens."""
    draw = Sampler.__call__

    def poisoned(self, logits, temperature, *args):
        if 0.77 in temperature:
            raise RuntimeError("poisoned row")
        return draw(self, logits, temperature, *args)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    ids = prompt_ids(20, seed=12)
    alone = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    before = success_counts(served.base)

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            calls = [client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True}),
                     client.completions.create(model=MODEL, prompt=prompt_ids(9, seed=1), max_tokens=24,
                                               temperature=0.9, seed=5, extra_body={"ignore_eos": True}),
                     client.completions.create(model=MODEL, prompt=prompt_ids(9, seed=2), max_tokens=24,
                                               temperature=0.77)]
            return await asyncio.gather(*calls, return_exceptions=True)

    greedy, sampled, poisoned_answer = asyncio.run(together())
    assert greedy.choices[0].text == alone and sampled.usage.completion_tokens == 24
    assert isinstance(poisoned_answer, openai.InternalServerError)
    assert poisoned_answer.body["code"] == "request_failed" and "poisoned row" in poisoned_answer.body["message"]
    wait_until(lambda: idle(served))
    after = success_counts(served.base)
    assert after["error"] - before["error"] == 1 and after["length"] - before["length"] == 2
    assert served.engine.cache.stats().pages_used == 0 and fetch(served.base, "GET", "/health")[0] == 200


# ---------------------------------------------------------------------------------- OpenAI errors
def test_every_bad_request_is_an_openai_error_within_a_second(served):
    def chat(**fields) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}

    cases = [  # (method, path, body, status, text in the message, param)
        ("POST", "/v1/completions", b"{not json", 400, "Invalid JSON", None),
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "Invalid JSON", None),
        ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "recursion limit", None),
        ("POST", "/v1/completions", b"[1, 2]", 400, "object", None),
        ("POST", "/v1/completions", b'{"model": "llama-tiny", "prompt": "\\ud800"}', 400, "Invalid JSON", None),
        ("GET", "/v1/nothing-here", None, 404, "Not Found", None),
        ("DELETE", "/v1/completions", None, 405, "Method Not Allowed", None),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
         400, "needs a string", "messages.0.content"),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
         400, "only text parts", "messages.0.content"),
        ("POST", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "x": 1}}]), 400,
         "Extra inputs", "tools.0.function.x"),
        ("POST", "/v1/chat/completions", chat(tool_choice="always"), 400, "'none', 'auto' or 'required'",
         "tool_choice"),
        ("POST", "/v1/chat/completions", chat(functions=[{"name": "f"}]), 400, "use tools", "functions"),
        ("POST", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
         "Field required", "response_format.json_schema.name"),
        ("POST", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
         400, "invalid json_schema: Pointer '/nowhere' does not exist", "response_format"),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "assistant", "tool_calls": [{"id": "1"}]}]), 400,
         "Field required", "messages.0.tool_calls.0.function"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x" * 513]}, 400, "512", "stop"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": float("nan")}, 400, "", "top_p"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(300)}},
         400, "outside the vocabulary", None),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 17, "max_tokens": 1}, 400, "--max-waiting",
         "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 9}, 400, "max_batch_size", None),
    ]
    for method, path, body, status, text, param in cases:
        start = time.perf_counter()
        raw = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        code, answer = fetch(served.base, method, path, raw)
        assert time.perf_counter() - start < 1.0, (path, body)
        assert_openai_error(code, json.loads(answer), status, text)
        assert json.loads(answer)["error"]["param"] == param, answer
    wait_until(lambda: idle(served))
    assert served.engine.cache.stats().pages_used == 0


def test_an_unexpected_error_is_a_500_with_a_reference_not_the_exception(served, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(served.server, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="flexpage.serve"):
        status, body = post(served.base, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert_openai_error(status, body, 500, "internal server error (error-")
    assert "secret" not in body["error"]["message"] and body["error"]["type"] == "server_error"
    reference = body["error"]["message"].split("(")[1].rstrip(")")
    assert any(reference in r.getMessage() and "secret internal detail" in r.exc_text for r in caplog.records)
    monkeypatch.undo()
    monkeypatch.setattr(served.engine, "add_request", broken)  # on the engine thread: that call alone fails
    status, body = post(served.base, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert_openai_error(status, body, 500, "internal server error (error-")
    monkeypatch.undo()
    assert fetch(served.base, "GET", "/health")[0] == 200
    assert served.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_large_bodies_are_refused_and_tokenising_never_stalls_the_loop(served):
    limit = served.server.max_request_bytes
    status, body = post(served.base, "/v1/completions", b" " * (limit + 1))  # a declared length past the limit
    assert_openai_error(status, body, 413, str(limit))

    def chunks():  # no declared length: counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    host, port = served.base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", body=chunks(), headers={"content-type": "application/json"},
                       encode_chunked=True)
    response = connection.getresponse()
    assert_openai_error(response.status, json.loads(response.read()), 413)
    connection.close()
    text = "paged attention over many pages " * (limit // 40)  # just under the limit: tokenised, then too long
    with health_probe(served.base) as latencies:
        status, body = post(served.base, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
        chat_status, chat_body = post(served.base, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    assert_openai_error(status, body, 400, "exceeds")
    assert_openai_error(chat_status, chat_body, 400, "exceeds")
    assert len(latencies) >= 5 and max(latencies) < HEALTH_SECONDS, sorted(latencies)[-3:]


def test_long_stop_strings_stream_in_linear_time(served):
    """Four stop strings of the longest length allowed, none of which appears: the stream is the
    plain output, held back only while its end could begin one of them."""
    ids = prompt_ids(20, seed=13)
    plain = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=200, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    stops = [plain[:3] + "\x00" * 509, "\x01" * 512, "\x02" * 512, "\x03" * 512]  # one begins like the output
    start = time.perf_counter()
    chunks = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=200, temperature=0, stop=stops,
                                              stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert time.perf_counter() - start < 30


# ---------------------------------------------------------------------------------- metrics
def test_metrics_count_each_request_once_by_reason_and_gauges_count_requests(served):
    wait_until(lambda: idle(served))
    before = success_counts(served.base)
    ids = prompt_ids(25, seed=14)
    full = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text  # length
    assert len(full) > 13
    served.client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0, n=2,
                                     stop=[full[10:13]], extra_body={"ignore_eos": True})  # two samples, one request
    host, port = served.base.removeprefix("http://").split(":")
    streams = []
    for n in (1, 3):  # two requests, four sequences
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", headers={"content-type": "application/json"}, body=json.dumps(
            {"model": MODEL, "prompt": prompt_ids(12, seed=n), "max_tokens": 1500, "ignore_eos": True, "n": n,
             "temperature": 0.8, "stream": True}))
        response = connection.getresponse()
        assert response.readline().startswith(b"data:")
        streams.append(connection)
    assert gauge(served.base, "num_requests_running") == 2
    assert gauge(served.base, "num_requests_waiting") == 0
    for connection in streams:
        connection.close()  # aborted
    wait_until(lambda: idle(served))
    after = success_counts(served.base)
    assert {k: after[k] - before[k] for k in after} == {"length": 1, "stop": 1, "abort": 2, "error": 0, "e2e": 4}
    assert gauge(served.base, "num_requests_running") == 0


# ---------------------------------------------------------------------------------- property test
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                                           inner, max_size=3),
                    max_leaves=12)
FIELDS = {  # each field's plausible and hostile values
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 300), max_size=20),
                        st.lists(st.text(max_size=10), max_size=3), JSON),
    "max_tokens": st.one_of(st.integers(-3, 6), st.sampled_from([0, 10**9, 2**64])),
    "temperature": st.one_of(st.sampled_from([0, 1e-300, 0.01, 1.0, 2.0, 2.5, -1]), JSON_LEAF),
    "top_p": st.one_of(st.floats(-1, 2), st.sampled_from([1e-300, 1.0])),
    "top_k": st.one_of(st.integers(-3, 400), st.sampled_from([2**63])),
    "seed": st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, -(2**63)])),
    "n": st.integers(-1, 10),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=600), max_size=5), JSON_LEAF),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans()),
    "top_logprobs": st.integers(-1, 25),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.one_of(st.sampled_from([1e-300, 0.01, 1.0, 100.0, 1e300]), st.floats(-1, 3)),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "255", "256", "-1", "x"]),
                                  st.one_of(st.floats(-200, 200), st.text(max_size=3)), max_size=4),
    "min_tokens": st.integers(-1, 8),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), JSON),
    "echo": st.booleans(), "best_of": st.integers(-1, 3), "suffix": st.text(max_size=3),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
         "content": st.one_of(st.text(max_size=20), st.none(), st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": JSON_LEAF}), max_size=2))}), max_size=3), JSON),
    "tools": st.one_of(st.none(), st.just([]), st.lists(JSON, min_size=1, max_size=2)),
    "response_format": st.one_of(st.none(), st.just({"type": "text"}), st.just({"type": "json_object"}), JSON),
    "model": st.one_of(st.just(MODEL), st.text(max_size=5)),
}
VALID = {"/v1/completions": {"model": MODEL, "prompt": "Once upon a time"},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]}}


def some_fields(most: int):
    """Up to ``most`` fields of ``FIELDS``, each with a value of its strategy."""
    return st.dictionaries(st.sampled_from(sorted(FIELDS)), st.just(None), max_size=most).flatmap(
        lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))


# a valid body with up to 5 fields replaced or added (plausible or hostile values), or up to 8 fields alone
BODIES = st.sampled_from(sorted(VALID)).flatmap(lambda path: st.tuples(st.just(path), st.one_of(
    some_fields(5).map(lambda fields: VALID[path] | fields), some_fields(8))))


def test_generated_bodies_never_get_a_5xx_and_leave_the_server_as_it_was(served):
    """Generated JSON bodies at both endpoints (bounded: 120 bodies, at most 8 output tokens each):
    never a 5xx, an OpenAI error body on every 4xx, /health always answering without a stall, the greedy
    reference text unchanged after, nothing running, waiting or held, and every request counted."""
    ids = prompt_ids(30, seed=15)
    reference = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0).choices[0].text
    wait_until(lambda: idle(served))
    before = success_counts(served.base)
    outcomes, probe, latencies = [], ExitStack(), None

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(BODIES)
    def battery(case):
        nonlocal latencies
        if latencies is None:  # from the first body on: hypothesis builds its strategies first, in this process
            latencies = probe.enter_context(health_probe(served.base))
        path, body = case
        if not isinstance(body.get("max_tokens"), int) or not 0 < body["max_tokens"] <= 6:
            body.setdefault("max_completion_tokens" if "chat" in path else "max_tokens", 4)
        status, text = fetch(served.base, "POST", path, json.dumps(body).encode(), timeout=60)
        assert status < 500, (status, text, body)
        if status >= 400:
            assert_openai_error(status, json.loads(text), status)
        outcomes.append(status)

    with probe:
        battery()
    # every probe answered; a bound on the slowest only, as a long test process on a shared machine
    # sees rare pauses of its own (the loop's latency under this load is measured apart from the tests)
    assert latencies and max(latencies) < STALL_SECONDS, sorted(latencies)[-3:]
    # some bodies were served, some refused (how many of each shifts with the project's code: hypothesis
    # draws some values from the string and number constants of the modules loaded)
    assert outcomes.count(200) >= 5 and 400 in outcomes
    wait_until(lambda: idle(served))
    assert served.engine.cache.stats().pages_used == 0
    assert gauge(served.base, "num_requests_running") == gauge(served.base, "num_requests_waiting") == 0
    after = success_counts(served.base)
    assert after["e2e"] - before["e2e"] == sum(after[k] - before[k] for k in ("stop", "length", "abort", "error"))
    assert after["e2e"] - before["e2e"] >= outcomes.count(200)
    assert served.client.completions.create(model=MODEL, prompt=ids, max_tokens=16,
                                            temperature=0).choices[0].text == reference


# ---------------------------------------------------------------------------------- operator options
def test_api_key_guards_v1_and_cors_allows_only_named_origins():
    engine = flexpage.Engine(zoo.build(MODEL), **ENGINE_OPTIONS)
    app = build_app(engine, zoo.load_tokenizer(MODEL), MODEL, api_key="sesame",
                    allowed_origins=["http://allowed.test"])
    with app_on_loopback(app) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, text = fetch(base, "GET", "/v1/models", headers=headers)
            assert_openai_error(status, json.loads(text), 401, "API key")
            assert json.loads(text)["error"]["code"] == "invalid_api_key"
        status, text = fetch(base, "POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode())
        assert status == 401
        assert fetch(base, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})[0] == 200
        assert fetch(base, "GET", "/health")[0] == 200 and fetch(base, "GET", "/metrics")[0] == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        preflight = {"Origin": "http://allowed.test", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = fetch_response(base, "OPTIONS", "/v1/completions", headers=preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://allowed.test"
        status, headers, _ = fetch_response(base, "OPTIONS", "/v1/completions",
                                            headers=preflight | {"Origin": "http://elsewhere.test"})
        assert status == 400 and "access-control-allow-origin" not in headers
    no_cors = build_app(engine, zoo.load_tokenizer(MODEL), MODEL)
    with app_on_loopback(no_cors) as base:
        status, headers, _ = fetch_response(base, "GET", "/health", headers={"Origin": "http://allowed.test"})
        assert status == 200 and "access-control-allow-origin" not in headers


@contextmanager
def serving_on_main_thread(engine, **config):
    """``serve()`` as ``flexpage serve`` runs it (engine on this thread, HTTP on another) once the
    block has started its client threads: yields the base URL, the uvicorn server and a dict that
    holds the app's ``runner`` and receives serve()'s result (``ok``)."""
    app = build_app(engine, zoo.load_tokenizer(MODEL), MODEL, engine_thread=False)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # uvicorn binds it next
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    result = {"runner": app.state.server.runner}
    yield f"http://127.0.0.1:{port}", server, result
    result["ok"] = serve(server, app.state.server.runner)


def test_engine_failure_answers_everyone_503_and_serve_exits_unsuccessfully(caplog):
    """A bug that stops the engine thread: the traceback is logged, the running stream and the
    request waiting behind it are answered at once (an error event, a 503), any later submit is
    refused (503), and ``serve()`` stops HTTP and returns False (``flexpage serve`` exits 1 so that
    a supervisor restarts it)."""
    engine = flexpage.Engine(zoo.build(MODEL), **dict(ENGINE_OPTIONS, max_batch_size=1, max_tokens_per_step=17))
    step, steps, broken = engine.step, [], threading.Event()

    def buggy():
        steps.append(1)
        if broken.is_set():
            raise KeyError("a bug in the engine")
        return step()

    engine.step = buggy
    answers, threads = {}, []

    def call(name: str, body: dict) -> None:
        thread = threading.Thread(target=lambda: answers.update({name: fetch(
            base, "POST", "/v1/completions", json.dumps({"model": MODEL, **body}).encode())}))
        thread.start()
        threads.append(thread)

    with caplog.at_level(logging.ERROR, logger="flexpage.serve"), \
            serving_on_main_thread(engine) as (base, server, result):
        def client() -> None:
            try:
                wait_until(lambda: server.started, 60)
                call("stream", {"prompt": "hello", "max_tokens": 1500, "stream": True, "ignore_eos": True})
                wait_until(lambda: steps, 30)  # the stream runs: the batch (one row) is full
                call("queued", {"prompt": "queued", "max_tokens": 5})
                wait_until(lambda: result["runner"].in_flight == 2, 30)
                broken.set()
                for thread in threads:
                    thread.join(timeout=30)
            finally:  # serve() stops by itself; a signal only if it did not (the test then fails)
                deadline = time.monotonic() + 30
                while not server.should_exit and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not server.should_exit:
                    signal.raise_signal(signal.SIGINT)

        threading.Thread(target=client, daemon=True).start()
    assert result["ok"] is False
    status, text = answers["queued"]
    assert_openai_error(status, json.loads(text), 503, "a bug in the engine")
    assert json.loads(text)["error"]["code"] == "engine_failed"
    status, text = answers["stream"]
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_failed"
    with pytest.raises(EngineFailedError, match="a bug in the engine"):
        asyncio.run(result["runner"].submit([[5, 6]], [flexpage.SamplingParams()], asyncio.Queue()))
    assert any("engine thread failed" in r.getMessage() and "a bug in the engine" in r.exc_text
               for r in caplog.records)


def test_shutdown_timeout_aborts_running_requests_and_frees_their_pages():
    engine = flexpage.Engine(zoo.build(MODEL), **ENGINE_OPTIONS)
    answers = {}
    with serving_on_main_thread(engine, timeout_graceful_shutdown=1) as (base, server, result):
        def client() -> None:
            try:
                wait_until(lambda: server.started, 60)
                host, port = base.removeprefix("http://").split(":")
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
                connection.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                                   body=json.dumps({"model": MODEL, "prompt": prompt_ids(20), "max_tokens": 2000,
                                                    "ignore_eos": True, "stream": True}))
                response = connection.getresponse()
                assert response.readline().startswith(b"data:")
                answers["pages"] = engine.cache.stats().pages_used
                answers["sent"] = time.perf_counter()
            finally:
                signal.raise_signal(signal.SIGTERM)

        threading.Thread(target=client, daemon=True).start()
    assert result["ok"] and answers["pages"] > 0
    assert time.perf_counter() - answers["sent"] < 15  # 1 s of grace, not the 2000 tokens
    assert engine.cache.stats().pages_used == 0 and not engine.has_work
