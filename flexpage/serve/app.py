"""The HTTP face of an Engine: OpenAI's completions and chat completions, models, health, metrics.

Handlers turn a request into token-id prompts and ``SamplingParams``, submit them to the engine
thread (``EngineRunner``), and turn its token events into text: incremental detokenisation, stop
strings (never sent, not even partly while streaming), logprobs, usage and finish reasons.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import Engine, SamplingParams, TokenLogprobs
from ..errors import InvalidRequestError
from .metrics import Metrics
from .protocol import (ChatCompletionRequest, CompletionRequest, ErrorBody, ErrorResponse, PromptTokensDetails,
                       SamplingRequest, Usage, new_id, now)
from .runner import EngineFailedError, EngineRunner, Output, QueueFullError


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, ErrorBody(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status)


class Choice:
    """One output's text so far: incremental detokenisation, stop strings, logprobs.

    Each token decodes only a short window (the tokens since the last complete character, after
    a few before them for context), so a long output costs linear time, not quadratic.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.logprobs: list[tuple[int, TokenLogprobs]] = []
        self.text, self.sent, self.finish_reason = "", 0, None
        self._prefix = self._read = 0  # tokens[_prefix:_read] give context; tokens[_read:] are not in text yet

    def add(self, output: Output) -> None:
        self.tokens.append(output.token)
        if output.logprobs is not None:
            self.logprobs.append((output.token, output.logprobs))
        searched = max(0, len(self.text) - max((len(s) for s in self.stops), default=0) + 1)
        self.text += self._new_text(final=output.finish_reason is not None)
        hits = [i for i in (self.text.find(s, searched) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.finish_reason = self.text[: min(hits)], "stop"
        elif output.finish_reason is not None:
            self.finish_reason = output.finish_reason

    def _new_text(self, final: bool) -> str:
        """The text the tokens since ``_read`` add, once it ends in a complete character (or ``final``)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.tokens[self._prefix : self._read])
        after = decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or a multi-byte character still incomplete
        self._prefix, self._read = max(0, len(self.tokens) - 4), len(self.tokens)
        return after[len(before) :]

    def delta(self) -> str:
        """Text not sent yet that no later token can change: a possible start of a stop string is
        held back until the output ends."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def token_text(self, token: int) -> str:
        """A token as text; a part of a multi-byte character, which has none, as its vocabulary entry."""
        text = self.tokenizer.decode([token])
        return self.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text


class Server:
    """The state behind one app: the engine thread, the tokenizer, the served model's name."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, max_waiting: int) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.metrics = Metrics(model_name)
        self.runner = EngineRunner(engine, self.metrics, max_waiting)

    def check_model(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def params(self, body: SamplingRequest, prompt_len: int, max_tokens: int | None, logprobs: int | None
               ) -> SamplingParams:
        if max_tokens is None:  # as OpenAI's chat: whatever room the sequence has left
            max_tokens = self.engine.max_seq_len - prompt_len
            if max_tokens < 1:
                raise APIError(400, f"the prompt's {prompt_len} tokens leave no room for output "
                                    f"(at most {self.engine.max_seq_len} tokens per sequence)", param="messages")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds the request's {max_tokens} output tokens",
                           param="min_tokens")
        greedy = body.temperature == 0
        return SamplingParams(
            max_new_tokens=max_tokens, do_sample=not greedy, temperature=1.0 if greedy else body.temperature,
            top_k=None if greedy or body.top_k in (None, -1) else body.top_k,
            top_p=None if greedy or body.top_p >= 1 else body.top_p, seed=body.seed,
            eos_token_id=[] if body.ignore_eos else None, num_return_sequences=body.n, logprobs=logprobs,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias, min_new_tokens=body.min_tokens,
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], stops: list[str]) -> Call:
        """Submit every prompt or none: a rejected one cancels those already queued."""
        events: asyncio.Queue = asyncio.Queue()
        requests = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                requests.append(await self.runner.submit(prompt, p, events, offset=i * p.num_return_sequences))
        except BaseException:
            for request in requests:
                self.runner.abort(request)
            raise
        choices = [Choice(self.tokenizer, stops) for r in requests for _ in range(r.n)]
        return Call(requests, events, choices)

    async def events(self, call: Call) -> AsyncIterator[int]:
        """Apply each engine event to its choice and yield the choice's number, until every choice
        has ended; aborts what is left if the consumer goes away (client disconnect)."""
        owner = {r.offset + j: r for r in call.requests for j in range(r.n)}
        try:
            while any(c.finish_reason is None for c in call.choices):
                output: Output = await call.events.get()
                if output.error is not None:
                    raise APIError(500, output.error, type="server_error", code="engine_step_failed")
                choice = call.choices[output.choice]
                if choice.finish_reason is not None:
                    continue  # a token produced before the engine saw this choice's stop-string abort
                choice.add(output)
                call.cached_tokens += output.cached_tokens
                if choice.finish_reason == "stop" and output.finish_reason is None:
                    request = owner[output.choice]  # a stop string: the engine need not go on
                    self.runner.abort_sample(request, output.choice - request.offset)
                yield output.choice
        finally:
            for request in call.requests:
                self.runner.abort(request)

    async def run(self, call: Call) -> None:
        async with aclosing(self.events(call)) as events:
            async for _ in events:
                pass


class Call:
    """One HTTP call: its engine requests, their shared event queue, one ``Choice`` per output."""

    def __init__(self, requests: list, events: asyncio.Queue, choices: list[Choice]) -> None:
        self.requests, self.events, self.choices = requests, events, choices
        self.cached_tokens = 0
        self.sent_logprobs = [0] * len(choices)  # logprobs already streamed, per choice

    def usage(self) -> dict:
        prompt = sum(r.prompt_len for r in self.requests)
        completion = sum(len(c.tokens) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens)).model_dump()


def completion_logprobs(choice: Choice, start: int, offset: int) -> dict | None:
    """OpenAI's legacy completions ``logprobs`` for the choice's tokens from ``start`` on."""
    if not choice.logprobs:
        return None
    tokens = [choice.token_text(t) for t, _ in choice.logprobs[start:]]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in choice.logprobs[start:]],
            "top_logprobs": [{choice.token_text(t): v for t, v in lp.top} for _, lp in choice.logprobs[start:]],
            "text_offset": offsets}


def chat_logprobs(choice: Choice, start: int) -> dict | None:
    """OpenAI's chat ``logprobs`` (``content`` entries) for the choice's tokens from ``start`` on."""
    if not choice.logprobs:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = choice.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for t, lp in choice.logprobs[start:]]}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a coroutine) but cancel it, which aborts its requests, if the client goes away."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "client disconnected")
    return task.result()


def build_app(engine: Engine, tokenizer: Any, model_name: str, max_waiting: int = 256,
              engine_thread: bool = True) -> FastAPI:
    """A FastAPI app serving ``engine``. With ``engine_thread`` the engine steps on a thread of its
    own that starts and stops with the app; without, the caller steps it on a thread it chooses
    with ``app.state.server.runner.run()``, which returns when the app stops."""
    server = Server(engine, tokenizer, model_name, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            server.runner.start()
        yield
        server.runner.stop()

    app = FastAPI(title="flexpage", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                            for e in error.errors())
        return APIError(400, message or "invalid request", param=where).response()

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, error: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(error)).response()

    @app.exception_handler(QueueFullError)
    async def busy(_: Request, error: QueueFullError) -> JSONResponse:
        return APIError(429, f"server busy: {error}", type="rate_limit_error", code="queue_full").response()

    @app.exception_handler(EngineFailedError)
    async def failed(_: Request, error: EngineFailedError) -> JSONResponse:
        return APIError(503, f"engine unavailable: {error}", type="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.runner.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "flexpage", "max_model_len": engine.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body)
        prompts = [server.encode(p) for p in body.prompts()]
        params = [server.params(body, len(p), body.max_tokens, body.logprobs) for p in prompts]
        call = await server.submit(prompts, params, body.stop_strings())
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model_name}

        def choice(i: int, text: str) -> dict:
            c = call.choices[i]
            start, call.sent_logprobs[i] = call.sent_logprobs[i], len(c.logprobs)
            return {"index": i, "text": text, "logprobs": completion_logprobs(c, start, c.sent - len(text)),
                    "finish_reason": c.finish_reason}

        if body.stream:
            return StreamingResponse(stream(server, call, head, body.include_usage, [], choice),
                                     media_type="text/event-stream")
        await unless_disconnected(request, server.run(call))
        return head | {"choices": [choice(i, c.delta()) for i, c in enumerate(call.choices)], "usage": call.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        top = (body.top_logprobs or 0) if body.logprobs else None
        call = await server.submit([prompt], [server.params(body, len(prompt), body.token_limit, top)],
                                   body.stop_strings())
        head = {"id": new_id("chatcmpl"), "created": now(), "model": model_name}

        def delta(i: int, text: str) -> dict:
            c = call.choices[i]
            start, call.sent_logprobs[i] = call.sent_logprobs[i], len(c.logprobs)
            return {"index": i, "delta": {"content": text} if text else {}, "logprobs": chat_logprobs(c, start),
                    "finish_reason": c.finish_reason}

        if body.stream:  # the role first, as OpenAI sends it
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(call.choices))]
            return StreamingResponse(stream(server, call, head | {"object": "chat.completion.chunk"},
                                            body.include_usage, roles, delta), media_type="text/event-stream")
        await unless_disconnected(request, server.run(call))
        return head | {"object": "chat.completion", "usage": call.usage(), "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": chat_logprobs(c, 0),
             "finish_reason": c.finish_reason} for i, c in enumerate(call.choices)]}

    return app


async def stream(server: Server, call: Call, head: dict, include_usage: bool, first: list[dict],
                 choice: Callable[[int, str], dict]) -> AsyncIterator[str]:
    """Server-sent events: ``first`` choices, then a chunk per choice whenever it has new text or
    ends, an error event if a step fails, the usage chunk if asked, and ``[DONE]``."""
    chunk = head | ({"usage": None} if include_usage else {})
    for entry in first:
        yield sse(chunk | {"choices": [entry]})
    try:
        async with aclosing(server.events(call)) as events:
            async for i in events:
                text = call.choices[i].delta()
                if text or call.choices[i].finish_reason is not None:
                    yield sse(chunk | {"choices": [choice(i, text)]})
    except APIError as error:
        yield sse(ErrorResponse(error=error.body).model_dump())
    else:
        if include_usage:
            yield sse(head | {"choices": [], "usage": call.usage()})
    yield sse("[DONE]")
