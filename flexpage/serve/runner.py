"""The engine thread: one thread owns the Engine and steps it; HTTP handlers talk to it through queues.

Handlers ``submit`` a call's requests and read their ``Output`` events from an asyncio queue; each
step's tokens are put on their requests' queues (thread-safely, on the event loop) as soon as the
step ends. Nothing on the event loop ever blocks on the engine, and nothing a request carries can
stop the thread: a failed step fails its requests, a request whose sampling fails fails alone.
If the thread stops anyway (a bug), the traceback is logged and every queued, submitted and
running request is answered at once (503); ``flexpage serve`` then exits non-zero.

On CPU the engine is best stepped on the thread that did the process's other torch work (built
the model, warmed the engine up): OpenMP keeps a worker team per thread that computes, and once
two teams exist on a few cores its workers stop spinning between parallel regions, so every
op waits for a woken worker. ``flexpage serve`` therefore runs the engine on its main thread and
HTTP on another.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine
from ..engine.requests import SamplingParams, TokenLogprobs
from ..errors import StepFailedError
from .metrics import Metrics

logger = logging.getLogger("flexpage.serve")

KEEPALIVE_SECONDS = 30.0  # under tensor parallelism, the longest the other ranks wait for a step
# a request's finish reason, from its samples' (the first listed wins)
REASON_ORDER = ("error", "abort", "length", "stop")


class QueueFullError(Exception):
    """The waiting room cannot take the call's requests now (HTTP 429: retry later)."""


class EngineFailedError(Exception):
    """The engine thread is not running (it failed, or the server is shutting down): HTTP 503."""


@dataclass
class Output:
    """One event of a request: a token of one of its outputs (``choice``: the request's ``offset``
    plus its sample number), the output's end, or an error (with its HTTP ``status``)."""

    choice: int
    token: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" (a stop token) or "length"; None while running
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (with sample 0's first token)
    error: str | None = None
    status: int = 500
    code: str | None = None


@dataclass(eq=False)
class Request:
    """A submitted request as the handler sees it: its engine indices and its event queue."""

    prompt_len: int
    n: int
    events: asyncio.Queue  # shared by the requests of one HTTP call
    offset: int = 0  # choice number of sample 0 within the HTTP call
    first: int = -1  # engine output index of sample 0
    arrival: float = field(default_factory=time.perf_counter)
    reasons: set[str] = field(default_factory=set)  # how its ended samples ended
    live: int = 0  # samples not ended yet


class EngineRunner:
    """Owns ``engine`` on a thread; ``max_waiting`` bounds the requests waiting to be admitted."""

    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int = 256) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.failure: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # a submit enters the inbox only while the thread will answer it
        self._closed: str | None = None  # why submits are refused (failure or shutdown)
        self._owners: dict[int, tuple[Request, asyncio.AbstractEventLoop]] = {}
        self._last_token: dict[int, float] = {}
        self._stopping = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Step the engine on a daemon thread of its own (see the module's note on CPU threads)."""
        self._thread = threading.Thread(target=self.run, name="flexpage-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Step the engine on the calling thread until ``stop()`` or a failure; then answer every
        request still queued or running (503) and free its pages."""
        try:
            self._loop()
        finally:
            self._stopped = True

    def stop(self) -> None:
        """Make ``run`` return (after the step in flight); wait for the engine's own thread, if any."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._stopped and not self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        """Outputs submitted and not ended yet."""
        return len(self._owners)

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     events: asyncio.Queue) -> list[Request]:
        """Queue a call's requests on the engine thread, all or none; raises ``InvalidRequestError``
        (400), ``QueueFullError`` (429) or ``EngineFailedError`` (503) when they cannot be served."""
        loop = asyncio.get_running_loop()
        requests, offset = [], 0
        for prompt, p in zip(prompts, params):
            requests.append(Request(len(prompt), p.num_return_sequences, events, offset))
            offset += p.num_return_sequences
        accepted = loop.create_future()
        with self._lock:
            if self._closed is not None:
                raise EngineFailedError(self._closed)
            self._inbox.put(("submit", requests, prompts, params, loop, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while queued: cancel them (after the submit, in order)
            for request in requests:
                self.abort(request)
            raise
        return requests

    def abort(self, request: Request) -> None:
        """Cancel a request (its client went away, or its call ended): pages freed on the engine thread."""
        self._inbox.put(("abort", request, "abort"))

    def end_sample(self, request: Request, sample: int, reason: str) -> None:
        """End one output of a request early (``reason``: "stop" for a stop string); the others go on."""
        self._inbox.put(("end_sample", request, sample, reason))

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            last_step = time.monotonic()
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_work)
                idle_ranks = self.engine.ranks is not None and time.monotonic() - last_step > KEEPALIVE_SECONDS
                if self.engine.has_work or idle_ranks:  # an idle step keeps followers' collectives alive
                    self._step()
                    last_step = time.monotonic()
        except Exception as error:  # a bug, not a request's doing: answer everyone, report unhealthy
            logger.exception("the engine thread failed; every request is answered 503 and the server stops")
            self.failure = f"{type(error).__name__}: {error}"
            self._close(f"the engine failed: {self.failure}", "engine_failed", free=False)
            return
        self._close("the server is shutting down", "shutting_down", free=True)
        self.engine.close()  # tensor-parallel followers stop with us

    def _close(self, message: str, code: str, free: bool) -> None:
        """Refuse new submits, answer queued submits and every request in flight with 503, and (if
        the engine still works) abort the latter so their pages are freed."""
        with self._lock:
            self._closed = message
        while True:
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                break
            if entry is not None and entry[0] == "submit":
                loop, accepted = entry[4], entry[5]
                loop.call_soon_threadsafe(_settle, accepted, EngineFailedError(message))
        indices = list(self._owners)
        if free and indices:
            self.engine.abort(indices)
        for index in indices:
            self._send(index, error=message, status=503, code=code)
            self._end(index, "error" if code == "engine_failed" else "abort")
        self._report()

    def _drain(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while message is not None:
            getattr(self, f"_on_{message[0]}")(*message[1:])
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _request_counts(self) -> tuple[int, int]:
        """Requests running (one of their outputs runs) and waiting (none does yet, or all were preempted)."""
        running, waiting = self.engine.queue()
        active = {id(self._owners[i][0]) for i in running if i in self._owners}
        return len(active), len({id(self._owners[i][0]) for i in waiting if i in self._owners} - active)

    def _on_submit(self, requests: list[Request], prompts, params, loop, accepted) -> None:
        waiting = self._request_counts()[1]
        if waiting + len(requests) > self.max_waiting:
            loop.call_soon_threadsafe(_settle, accepted, QueueFullError(
                f"{waiting} of {self.max_waiting} waiting places are taken; this call needs {len(requests)}"))
            return
        added = []
        try:
            for request, prompt, p in zip(requests, prompts, params):
                request.first = self.engine.add_request(prompt, p)
                added.append(request)
        except Exception as error:  # noqa: BLE001 - refused alone (a 400, or a 500 the app logs), never the thread's end
            if added:  # all or none
                self.engine.abort([r.first + j for r in added for j in range(r.n)])
            loop.call_soon_threadsafe(_settle, accepted, error)
            return
        for request, prompt in zip(requests, prompts):
            request.live = request.n
            for j in range(request.n):
                self._owners[request.first + j] = (request, loop)
            self.metrics.request_received(len(prompt))
        self._report()
        loop.call_soon_threadsafe(_settle, accepted, None)

    def _on_abort(self, request: Request, reason: str) -> None:
        self._drop(range(request.first, request.first + request.n), reason)

    def _on_end_sample(self, request: Request, sample: int, reason: str) -> None:
        self._drop([request.first + sample], reason)

    def _drop(self, indices, reason: str) -> None:
        indices = [i for i in indices if i in self._owners]
        if not indices:
            return
        self.engine.abort(indices)
        for index in indices:
            self._end(index, reason)
        self._report()

    def _end(self, index: int, reason: str) -> None:
        """Forget an ended output; the request is counted as finished once its last output ends."""
        request = self._owners.pop(index)[0]
        self._last_token.pop(index, None)
        request.reasons.add(reason)
        request.live -= 1
        if request.live == 0:
            finished = next(r for r in REASON_ORDER if r in request.reasons)
            self.metrics.request_finished(finished, time.perf_counter() - request.arrival)

    def _step(self) -> None:
        engine = self.engine
        preemptions = engine.preemptions
        try:
            records = engine.step()
        except StepFailedError as error:  # fail the step's requests, free their pages, serve the others
            self._fail(error.requests, f"the step serving this request failed: {error.__cause__!r}",
                       "engine_step_failed")
            return
        now = time.perf_counter()
        if records and engine.history[-1].verifications:  # a step with records is the history's latest
            latest = engine.history[-1]
            self.metrics.speculation(latest.verifications, latest.drafted_tokens, latest.accepted_tokens)
        for record in records:
            index = record.index
            if index not in self._owners:  # aborted since
                continue
            if record.error is not None:  # the engine aborted it already
                self._fail([index], f"this request failed: {record.error}", "request_failed")
                continue
            request = self._owners[index][0]
            first = index not in self._last_token
            self.metrics.token(now - (request.arrival if first else self._last_token[index]), first)
            self._last_token[index] = now
            cached = (record.cached_tokens or 0) if index == request.first else 0
            self.metrics.prefix_hits(cached)  # the prompt's cache hits, once per request (with sample 0)
            self._send(index, token=record.token, logprobs=record.logprobs, finish_reason=record.finish_reason,
                       cached_tokens=cached)
            if record.finish_reason is not None:
                self._end(index, record.finish_reason)
        self._report(engine.preemptions - preemptions)

    def _fail(self, indices: list[int], message: str, code: str) -> None:
        """Answer the outputs' requests with a 500 error, after their pages were freed."""
        indices = [i for i in indices if i in self._owners]
        self.engine.abort(indices)  # a no-op for those the engine dropped already
        for index in indices:
            self._send(index, error=message, status=500, code=code)
            self._end(index, "error")
        self._report()

    def _report(self, preemptions: int = 0) -> None:
        """Gauges in requests (``_request_counts``), KV usage, preemptions."""
        stats = self.engine.cache.stats()
        self.metrics.step(*self._request_counts(), stats.pages_used / stats.pages_total, preemptions)

    def _send(self, index: int, **fields) -> None:
        request, loop = self._owners[index]
        loop.call_soon_threadsafe(request.events.put_nowait, Output(request.offset + index - request.first, **fields))


def _settle(future: asyncio.Future, result: BaseException | None) -> None:
    """Resolve a submit's future on its event loop (unless its client already left)."""
    if future.done():
        return
    if result is None:
        future.set_result(None)
    else:
        future.set_exception(result)
