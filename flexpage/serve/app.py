"""The HTTP face of an Engine: OpenAI's completions and chat completions, models, health, metrics.

Handlers turn a request into token-id prompts and ``SamplingParams`` (a structured output or forced
tool calls compiled to a grammar), submit them to the engine thread (``EngineRunner``), and turn
its token events into text: incremental detokenisation, stop strings (never sent, not even partly
while streaming), tool calls (``tools``), logprobs, usage and finish reasons.

The event loop never waits on work that grows with a request: bodies are read up to a size
limit, parsed, tokenised (chat templates too) and rendered as JSON on worker threads; each token's
detokenisation looks at a window of a few tokens, and stop strings are matched once per
character. Every error a client sees is an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..engine import Engine
from ..engine.requests import SamplingParams, TokenLogprobs
from ..engine.structured import Grammar, Grammars
from ..errors import InvalidRequestError
from .metrics import Metrics
from .protocol import (ChatCompletionRequest, CompletionRequest, ErrorBody, ErrorResponse, PromptTokensDetails,
                       SamplingRequest, Usage, new_id, now)
from .runner import EngineFailedError, EngineRunner, Output, QueueFullError
from .tools import ToolCallReader, tool_calls_grammar

logger = logging.getLogger("flexpage.serve")

MAX_REQUEST_BYTES = 1 << 19  # default request-body limit (413 above it): tokenisers hold the GIL a while per MB
MAX_ERROR_CHARS = 1000  # an error message's length at most
RETRY_AFTER_SECONDS = 1  # a 429's Retry-After
PENDING_TOKENS = 8  # tokens held back at most for an incomplete character (one takes at most 4 bytes)
MIN_LOGPROB = -9999.0  # a log-probability of -inf (or NaN) is reported as this: JSON has no infinities (vLLM's)
HTTP_WORKERS = 2  # threads that parse, tokenise and render for the event loop
T = TypeVar("T", bound=BaseModel)


class APIError(Exception):
    """An error answered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.status, self.headers = status, headers
        self.body = ErrorBody(message=message[:MAX_ERROR_CHARS], type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status, headers=self.headers)


class StopStrings:
    """Finds the first stop string in a text that grows: one Knuth-Morris-Pratt matcher per
    string, so each character is looked at once however long the text and the strings are; the
    longest end of the text that may still begin a stop string is known at every point."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.fallbacks = [_prefix_function(s) for s in stops]
        self.matched = [0] * len(stops)  # characters of each string matched by the text's end
        self.length = 0  # characters fed so far

    def feed(self, text: str, report: bool = True) -> int | None:
        """Add ``text`` to the end; where the first stop string to be completed starts in the whole
        text (the earliest of those completed by the same character), or None; never with ``report``
        False (the output is too short to stop: the text is only followed)."""
        for char in text:
            starts = []
            for k, (stop, fallback) in enumerate(zip(self.stops, self.fallbacks)):
                j = self.matched[k]
                while j and stop[j] != char:
                    j = fallback[j - 1]
                j += stop[j] == char
                if j == len(stop):
                    starts.append(self.length + 1 - j)
                    j = fallback[j - 1]  # matching goes on where the output is too short to stop
                self.matched[k] = j
            self.length += 1
            if starts and report:
                return min(starts)
        return None

    @property
    def partial(self) -> int:
        """The longest end of the text that is a proper beginning of a stop string."""
        return max(self.matched, default=0)


def _prefix_function(text: str) -> list[int]:
    """For each prefix of ``text``, the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(text)
    for i in range(1, len(text)):
        j = table[i - 1]
        while j and text[i] != text[j]:
            j = table[j - 1]
        table[i] = j + (text[i] == text[j])
    return table


class Choice:
    """One output's text so far: incremental detokenisation, stop strings, logprobs.

    Each token decodes only a short window (the tokens since the last complete character, after
    a few before them for context), so a long output costs linear time, not quadratic.
    """

    def __init__(self, tokenizer: Any, stops: list[str], min_tokens: int = 0) -> None:
        self.tokenizer, self.stops, self.min_tokens = tokenizer, StopStrings(stops), min_tokens
        self.tokens: list[int] = []
        self.logprobs: list[tuple[int, TokenLogprobs]] = []
        self.text, self.sent, self.finish_reason = "", 0, None
        self._prefix = self._read = 0  # tokens[_prefix:_read] give context; tokens[_read:] are not in text yet

    def add(self, output: Output) -> None:
        self.tokens.append(output.token)
        if output.logprobs is not None:
            self.logprobs.append((output.token, output.logprobs))
        new = self._new_text(final=output.finish_reason is not None)
        start = self.stops.feed(new, report=len(self.tokens) >= self.min_tokens)  # vLLM: none before min_tokens
        self.text += new
        if start is not None:
            self.text, self.finish_reason = self.text[:start], "stop"
        elif output.finish_reason is not None:
            self.finish_reason = output.finish_reason

    def _new_text(self, final: bool) -> str:
        """The text the tokens since ``_read`` add, once it ends in a complete character (or
        ``final``, or ``PENDING_TOKENS`` tokens still make none: they stay replacement characters)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.tokens[self._prefix : self._read])
        after = decode(self.tokens[self._prefix :])
        incomplete = after.endswith("\ufffd") and not final and len(self.tokens) - self._read < PENDING_TOKENS
        if after == before:  # tokens that add no text (special ones): the window moves on
            self._prefix, self._read = max(0, len(self.tokens) - 4), len(self.tokens)
            return ""
        if len(after) < len(before) or incomplete:
            return ""  # nothing new yet, or a multi-byte character still incomplete
        self._prefix, self._read = max(0, len(self.tokens) - 4), len(self.tokens)
        return after[len(before) :]

    def delta(self) -> str:
        """Text not sent yet that no later token can change: a possible start of a stop string is
        held back until the output ends."""
        end = len(self.text) - (0 if self.finish_reason is not None else self.stops.partial)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def token_text(self, token: int) -> str:
        """A token as text; a part of a multi-byte character, which has none, as its vocabulary entry."""
        text = self.tokenizer.decode([token])
        return self.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text


class Server:
    """The state behind one app: the engine thread, the tokenizer, the served model's name, and
    the worker threads that keep parsing, tokenising and rendering off the event loop."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, max_waiting: int,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_request_bytes = max_request_bytes
        self.metrics = Metrics(model_name, engine.cache.bytes_per_token)
        self.runner = EngineRunner(engine, self.metrics, max_waiting)
        self.workers = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="flexpage-http-work")
        self.grammars = Grammars(tokenizer, engine.model.config.vocab_size)

    async def off_loop(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, work, *args)

    async def parse(self, request: Request, model: type[T]) -> T:
        """The request's JSON body as ``model``: 413 past the size limit, 400 naming what is wrong."""
        media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            # a browser sends text/plain and forms cross-site without asking first: only JSON is taken
            raise APIError(415, f"the request body must be JSON (content-type application/json), not {media[:60]!r}",
                           code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise self.too_large()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                raise self.too_large()
        try:
            parsed = await self.off_loop(model.model_validate_json, bytes(body))
        except ValidationError as error:
            raise validation_error(error.errors(include_url=False, include_input=False)) from None
        unsupported = parsed.unsupported()
        if unsupported:
            raise APIError(400, f"unsupported field {unsupported[0]!r}: this server does not implement it (fields "
                                f"it does not implement are refused, not ignored)", param=unsupported[0],
                           code="unsupported_field")
        return parsed

    def too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_request_bytes} bytes (the server's "
                             f"--max-request-bytes)", code="request_too_large")

    def check_model(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(400, f"model {body.model[:100]!r} is not served here; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def check_prompts(self, count: int) -> None:
        """A call's prompts must fit the waiting room at once, or it could never be admitted."""
        if count > self.runner.max_waiting:
            raise APIError(400, f"{count} prompts in one call: this server holds at most {self.runner.max_waiting} "
                                f"waiting requests (--max-waiting)", param="prompt", code="too_many_prompts")

    def grammar(self, body: SamplingRequest) -> Grammar | None:
        """The request's structured output (or forced tool calls) compiled, or None; a 400 naming
        the field if it is invalid (a worker thread's job: compiling a schema takes a while)."""
        if isinstance(body, ChatCompletionRequest) and body.calls_forced:
            field, kind, spec = "tools", "grammar", tool_calls_grammar(body.callable_tools(), body.parallel_tool_calls)
        elif (found := body.grammar_spec()) is not None:
            field, kind, spec = found
        else:
            return None
        try:
            return self.grammars.compile(kind, spec)
        except InvalidRequestError as error:
            raise APIError(400, f"{field}: {error}", param=field, code="invalid_grammar") from None

    def params(self, body: SamplingRequest, prompt_len: int, max_tokens: int | None, logprobs: int | None,
               grammar: Grammar | None = None) -> SamplingParams:
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
            eos_token_id=self.stop_tokens(body), num_return_sequences=body.n, logprobs=logprobs,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias, min_new_tokens=body.min_tokens,
            grammar=grammar,
        )

    def stop_tokens(self, body: SamplingRequest) -> list[int] | None:
        """The tokens that end an output: the model's end-of-sequence tokens (unless ``ignore_eos``)
        and vLLM's ``stop_token_ids``; None: the model's alone."""
        if not body.ignore_eos and not body.stop_token_ids:
            return None
        eos = [] if body.ignore_eos else self.engine.model.generation_config.eos_token_id
        return [*([eos] if isinstance(eos, int) else eos or []), *body.stop_token_ids]

    def encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt (a worker thread's job: tokenising may take long)."""
        return [list(self._tokenized(p)) if isinstance(p, str) else list(p) for p in prompts]

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template applied to ``messages`` and ``tools``, as token ids (a worker thread's job)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
        except (TemplateError, TypeError, ValueError) as error:  # a template may refuse roles or orders
            raise APIError(400, f"the model's chat template refused the messages: {error}", param="messages") from None
        return list(self._tokenized(text, add_special_tokens=False))

    def _tokenized(self, text: str, **options: Any) -> list[int]:
        try:
            return self.tokenizer(text, **options)["input_ids"]
        except (TypeError, ValueError) as error:  # the tokenizer refuses the text (e.g. a lone surrogate)
            raise APIError(400, f"the text could not be tokenised: {error}", param="prompt") from None

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], stops: list[str]) -> Call:
        """Submit every prompt or none."""
        events: asyncio.Queue = asyncio.Queue()
        requests = await self.runner.submit(prompts, params, events)
        choices = [Choice(self.tokenizer, stops, p.min_new_tokens) for r, p in zip(requests, params) for _ in range(r.n)]
        return Call(requests, events, choices)

    async def events(self, call: Call) -> AsyncIterator[int]:
        """Apply each engine event to its choice and yield the choice's number, until every choice
        has ended; aborts what is left if the consumer goes away (client disconnect)."""
        owner = {r.offset + j: r for r in call.requests for j in range(r.n)}
        try:
            while any(c.finish_reason is None for c in call.choices):
                output: Output = await call.events.get()
                if output.error is not None:
                    raise APIError(output.status, output.error, code=output.code)
                choice = call.choices[output.choice]
                if choice.finish_reason is not None:
                    continue  # a token produced before the engine saw this choice's stop-string end
                choice.add(output)
                call.cached_tokens += output.cached_tokens
                if choice.finish_reason == "stop" and output.finish_reason is None:
                    request = owner[output.choice]  # a stop string: the engine need not go on
                    self.runner.end_sample(request, output.choice - request.offset, "stop")
                yield output.choice
        finally:
            for request in call.requests:
                self.runner.abort(request)

    async def run(self, call: Call) -> None:
        async with aclosing(self.events(call)) as events:
            async for _ in events:
                pass

    async def render(self, build: Callable[[], dict]) -> Response:
        """A JSON response built and serialised on a worker thread (a long output with logprobs
        is megabytes of JSON)."""
        return Response(await self.off_loop(lambda: json.dumps(build())), media_type="application/json")


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


def finish_reason(choice: Choice, reader: ToolCallReader | None) -> str | None:
    """The choice's finish reason, "tool_calls" where it stopped after calling tools (as OpenAI's)."""
    if choice.finish_reason == "stop" and reader is not None and reader.calls:
        return "tool_calls"
    return choice.finish_reason


def reported(logprob: float) -> float:
    """A log-probability as JSON can carry it."""
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(choice: Choice, start: int, offset: int) -> dict | None:
    """OpenAI's legacy completions ``logprobs`` for the choice's tokens from ``start`` on."""
    if not choice.logprobs:
        return None
    tokens = [choice.token_text(t) for t, _ in choice.logprobs[start:]]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": [reported(lp.logprob) for _, lp in choice.logprobs[start:]],
            # as OpenAI's: the sampled token among each position's alternatives, whatever its rank
            "top_logprobs": [{choice.token_text(i): reported(v) for i, v in lp.top} | {choice.token_text(t): reported(lp.logprob)}
                             for t, lp in choice.logprobs[start:]],
            "text_offset": offsets}


def chat_logprobs(choice: Choice, start: int) -> dict | None:
    """OpenAI's chat ``logprobs`` (``content`` entries) for the choice's tokens from ``start`` on."""
    if not choice.logprobs:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = choice.token_text(token)
        return {"token": text, "logprob": reported(logprob), "bytes": list(text.encode())}

    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for t, lp in choice.logprobs[start:]]}


def internal_error(what: str, error: BaseException) -> APIError:
    """A 500 naming only a reference; the exception goes to the log under that reference."""
    reference = new_id("error")
    logger.error("%s: %s failed", reference, what, exc_info=error)
    return APIError(500, f"internal server error ({reference})")


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the first wrong field, with a bounded message."""
    def where(loc: tuple) -> str:  # the field path, without pydantic's union-branch tags ("str", "list[int]")
        parts = []
        for part in loc:
            if isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part):
                break
            parts.append(str(part))
        return ".".join(parts)

    seen = dict.fromkeys(f"{where(e.get('loc', ())) or 'body'}: {str(e.get('msg'))[:200]}" for e in errors)
    return APIError(400, "; ".join(list(seen)[:3]) or "invalid request",
                    param=where(errors[0].get("loc", ())) or None if errors else None)


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


class RequireAPIKey:
    """ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 otherwise);
    ``/health`` and ``/metrics`` stay open, as in vLLM."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Engine, tokenizer: Any, model_name: str, max_waiting: int = 256,
              engine_thread: bool = True, max_request_bytes: int | None = None, api_key: str | None = None,
              allowed_origins: list[str] | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``. With ``engine_thread`` the engine steps on a thread of its
    own that starts and stops with the app; without, the caller steps it on a thread it chooses
    with ``app.state.server.runner.run()``, which returns when the app stops. ``api_key``: the
    Bearer token ``/v1/*`` requires; ``allowed_origins``: origins CORS lets call (none by default);
    ``max_request_bytes``: the largest body accepted (default ``MAX_REQUEST_BYTES``)."""
    server = Server(engine, tokenizer, model_name, max_waiting, max_request_bytes or MAX_REQUEST_BYTES)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # the model, the engine and the imports are here to stay: freeze them out of the cyclic GC's
        # reach, whose full passes (over all of them) would stop every thread, the event loop too (as vLLM)
        gc.collect()
        gc.freeze()
        if engine_thread:
            server.runner.start()
        yield
        server.runner.stop()
        server.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flexpage", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(RequireAPIKey, key=api_key)
    if allowed_origins:  # outermost, so preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)  # unknown routes, wrong methods, unparsable bodies
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error([e | {"loc": tuple(e.get("loc", ()))[1:]} for e in error.errors()]).response()

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, error: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(error)).response()

    @app.exception_handler(QueueFullError)
    async def busy(_: Request, error: QueueFullError) -> JSONResponse:
        return APIError(429, f"server busy: {error}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()

    @app.exception_handler(EngineFailedError)
    async def failed(_: Request, error: EngineFailedError) -> JSONResponse:
        return APIError(503, f"engine unavailable: {error}", code="engine_unavailable").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return internal_error(f"{request.method} {request.url.path}", error).response()

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
    async def completions(request: Request):
        body = await server.parse(request, CompletionRequest)
        server.check_model(body)
        server.check_prompts(len(body.prompts()))
        prompts = await server.off_loop(server.encode, body.prompts())
        grammar = await server.off_loop(server.grammar, body)
        params = [server.params(body, len(p), body.max_tokens, body.logprobs, grammar) for p in prompts]
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
        return await server.render(lambda: head | {"choices": [choice(i, c.delta()) for i, c in enumerate(call.choices)],
                                                   "usage": call.usage()})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.parse(request, ChatCompletionRequest)
        server.check_model(body)
        messages = [m.for_template() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt = await server.off_loop(server.chat_prompt, messages, tools)
        grammar = await server.off_loop(server.grammar, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        call = await server.submit([prompt], [server.params(body, len(prompt), body.token_limit, top, grammar)],
                                   body.stop_strings())
        head = {"id": new_id("chatcmpl"), "created": now(), "model": model_name}
        readers = [ToolCallReader(body.callable_tools()) if body.tool_mode != "none" else None
                   for _ in call.choices]

        def delta(i: int, text: str) -> dict | None:
            c, reader = call.choices[i], readers[i]
            content, calls = reader.feed(text, c.finish_reason is not None) if reader else (text, [])
            if not (content or calls or c.finish_reason):
                return None  # text held back: it may be a tool call
            start, call.sent_logprobs[i] = call.sent_logprobs[i], len(c.logprobs)
            out = {"content": content} if content else {}
            if calls:
                first = len(reader.calls) - len(calls)
                out["tool_calls"] = [call_entry | {"index": first + k} for k, call_entry in enumerate(calls)]
            return {"index": i, "delta": out, "logprobs": chat_logprobs(c, start),
                    "finish_reason": finish_reason(c, reader)}

        def message(i: int) -> dict:
            c, reader = call.choices[i], readers[i]
            content, calls = reader.feed(c.text, True) if reader else (c.text, [])
            return {"index": i, "message": {"role": "assistant", "content": content if content or not calls else None}
                    | ({"tool_calls": calls} if calls else {}),
                    "logprobs": chat_logprobs(c, 0), "finish_reason": finish_reason(c, reader)}

        if body.stream:  # the role first, as OpenAI sends it
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(call.choices))]
            return StreamingResponse(stream(server, call, head | {"object": "chat.completion.chunk"},
                                            body.include_usage, roles, delta), media_type="text/event-stream")
        await unless_disconnected(request, server.run(call))
        return await server.render(lambda: head | {"object": "chat.completion", "usage": call.usage(),
                                                   "choices": [message(i) for i in range(len(call.choices))]})

    return app


async def stream(server: Server, call: Call, head: dict, include_usage: bool, first: list[dict],
                 choice: Callable[[int, str], dict | None]) -> AsyncIterator[str]:
    """Server-sent events: ``first`` choices, then a chunk per choice whenever it has new text or
    ends (``choice`` builds it: None for nothing to send yet), an error event if the request
    fails, the usage chunk if asked, and ``[DONE]``."""
    chunk = head | ({"usage": None} if include_usage else {})
    for entry in first:
        yield sse(chunk | {"choices": [entry]})
    try:
        async with aclosing(server.events(call)) as events:
            async for i in events:
                text = call.choices[i].delta()
                if (text or call.choices[i].finish_reason is not None) and (entry := choice(i, text)) is not None:
                    yield sse(chunk | {"choices": [entry]})
    except APIError as error:
        yield sse(ErrorResponse(error=error.body).model_dump())
    except Exception as error:  # noqa: BLE001 - the status line is sent: an error event is all that is left
        yield sse(ErrorResponse(error=internal_error("a stream", error).body).model_dump())
    else:
        if include_usage:
            yield sse(head | {"choices": [], "usage": call.usage()})
    yield sse("[DONE]")
