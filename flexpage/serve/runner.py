"""The engine thread: one thread owns the Engine and steps it; HTTP handlers talk to it through queues.

Handlers ``submit`` a request and read its ``Output`` events from an asyncio queue; each step's
tokens are put on their requests' queues (thread-safely, on the event loop) as soon as the step
ends. Nothing on the event loop ever blocks on the engine.

On CPU the engine is best stepped on the thread that did the process's other torch work (built
the model, warmed the engine up): OpenMP keeps a worker team per thread that computes, and once
two teams exist on a few cores its workers stop spinning between parallel regions, so every
op waits for a woken worker (a decode step of the benchmark model took 1.4x as long on a second
thread). ``flexpage serve`` therefore runs the engine on its main thread and HTTP on another.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine, SamplingParams, TokenLogprobs
from ..errors import InvalidRequestError, StepFailedError
from .metrics import Metrics


KEEPALIVE_SECONDS = 30.0  # under tensor parallelism, the longest the other ranks wait for a step


class QueueFullError(Exception):
    """The waiting queue holds ``max_waiting`` requests already (HTTP 429)."""


class EngineFailedError(Exception):
    """The engine thread stopped on an unexpected error; the server can no longer serve."""


@dataclass
class Output:
    """One event of a request: a token of one of its outputs (``choice``: the request's ``offset``
    plus its sample number), the output's end, or an error."""

    choice: int
    token: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" (a stop token) or "length"; None while running
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (with sample 0's first token)
    error: str | None = None


@dataclass
class Request:
    """A submitted request as the handler sees it: its engine indices and its event queue."""

    prompt_len: int
    n: int
    events: asyncio.Queue  # may be shared by the requests of one HTTP call
    offset: int = 0  # choice number of sample 0 within the HTTP call
    first: int = -1  # engine output index of sample 0
    arrival: float = field(default_factory=time.perf_counter)


class EngineRunner:
    """Owns ``engine`` on a daemon thread; ``max_waiting`` bounds the queue of not-yet-running requests."""

    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int = 256) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.failure: str | None = None
        self._inbox: queue.Queue = queue.Queue()
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
        """Step the engine on the calling thread until ``stop()``; requests submitted earlier wait."""
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
        return self.failure is None and not self._stopped

    async def submit(self, prompt: list[int], params: SamplingParams, events: asyncio.Queue,
                     offset: int = 0) -> Request:
        """Queue a request on the engine thread; raises ``InvalidRequestError``, ``QueueFullError``
        or ``EngineFailedError`` (and queues nothing) when it cannot be served."""
        if not self.healthy:
            raise EngineFailedError(self.failure or "the engine thread is not running")
        loop = asyncio.get_running_loop()
        request = Request(len(prompt), params.num_return_sequences, events, offset)
        accepted = loop.create_future()
        self._inbox.put(("submit", request, prompt, params, loop, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left while queued: cancel it (after the submit, in order)
            self.abort(request)
            raise
        return request

    def abort(self, request: Request) -> None:
        """Cancel a request (a client gone, a stop string seen): its pages are freed on the engine thread."""
        self._inbox.put(("abort", request))

    def abort_sample(self, request: Request, sample: int) -> None:
        """Cancel one output of a request (its stop string was seen); the others go on."""
        self._inbox.put(("abort_sample", request, sample))

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            last_step = time.monotonic()
            while not self._stopping.is_set():
                self._drain(block=not self.engine.scheduler.has_work)
                idle_ranks = self.engine.ranks is not None and time.monotonic() - last_step > KEEPALIVE_SECONDS
                if self.engine.scheduler.has_work or idle_ranks:  # an idle step keeps followers' collectives alive
                    self._step()
                    last_step = time.monotonic()
            self.engine.close()  # tensor-parallel followers stop with us
        except Exception as error:  # a bug, not a failed step: fail everyone, report unhealthy
            self.failure = f"{type(error).__name__}: {error}"
            for index, owner in list(self._owners.items()):
                self._send(index, owner, error=self.failure)
            self._owners.clear()

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

    def _on_submit(self, request: Request, prompt, params, loop, accepted) -> None:
        def reply(result: BaseException | None) -> None:
            if not accepted.done():
                if result is None:
                    accepted.set_result(None)
                else:
                    accepted.set_exception(result)

        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            loop.call_soon_threadsafe(reply, QueueFullError(f"{self.max_waiting} requests are already waiting"))
            return
        try:
            request.first = self.engine.add_request(prompt, params)
        except InvalidRequestError as error:
            loop.call_soon_threadsafe(reply, error)
            return
        for j in range(request.n):
            self._owners[request.first + j] = (request, loop)
        self.metrics.request_received(len(prompt))
        loop.call_soon_threadsafe(reply, None)

    def _on_abort(self, request: Request) -> None:
        self._drop(range(request.first, request.first + request.n))

    def _on_abort_sample(self, request: Request, sample: int) -> None:
        self._drop([request.first + sample])

    def _drop(self, indices) -> None:
        indices = [i for i in indices if i in self._owners]
        self.engine.abort(indices)
        for index in indices:
            self._forget(index)
        self._report()

    def _forget(self, index: int) -> None:
        self._owners.pop(index, None)
        self._last_token.pop(index, None)
        for record in (self.engine.first_token_seconds, self.engine.cached_prompt_tokens, self.engine.finish_reasons):
            record.pop(index, None)

    def _step(self) -> None:
        engine = self.engine
        preemptions = engine.scheduler.preemptions
        try:
            produced = engine.step()
        except StepFailedError as error:  # fail the step's requests, free their pages, serve the others
            message = f"the step serving this request failed: {error.__cause__!r}"
            owners = {index: self._owners[index] for index in error.requests if index in self._owners}
            self._drop(error.requests)  # pages freed before anyone hears of the failure
            for index, owner in owners.items():
                self._send(index, owner, error=message)
            return
        now = time.perf_counter()
        for index, token in produced:
            if index not in self._owners:  # aborted since
                continue
            request = self._owners[index][0]
            reason = engine.finish_reasons.get(index)
            first = index not in self._last_token
            self.metrics.token(now - (request.arrival if first else self._last_token[index]), first)
            self._last_token[index] = now
            cached = engine.cached_prompt_tokens.get(index, 0) if first and index == request.first else 0
            self.metrics.prefix_hits(cached)  # the prompt's cache hits, once per request (with sample 0)
            self._send(index, self._owners[index], token=token, logprobs=engine.step_logprobs.get(index),
                       finish_reason=reason, cached_tokens=cached)
            if reason is not None:
                self.metrics.request_finished(reason, now - request.arrival)
                self._forget(index)
        self._report(engine.scheduler.preemptions - preemptions)

    def _report(self, preemptions: int = 0) -> None:
        stats, scheduler = self.engine.cache.stats(), self.engine.scheduler
        self.metrics.step(len(scheduler.running), len(scheduler.waiting), stats.pages_used / stats.pages_total,
                          preemptions)

    def _send(self, index: int, owner: tuple[Request, asyncio.AbstractEventLoop], **fields) -> None:
        request, loop = owner
        loop.call_soon_threadsafe(request.events.put_nowait, Output(request.offset + index - request.first, **fields))
