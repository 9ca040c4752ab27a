"""Loopback HTTP helpers shared by the server tests."""

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import openai
import torch
import uvicorn

import flexpage
from flexpage import zoo
from flexpage.bench.measure import stop_process
from flexpage.serve import build_app

# the Engine options of tests/test_engine.py: the same compiled step shapes
ENGINE_OPTIONS = dict(page_size=16, max_cached_tokens=2048, max_batch_size=8, max_tokens_per_step=128)


def free_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of the tiny zoo vocabulary, past its special tokens."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fetch(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
          timeout: float = 60) -> tuple[int, str]:
    """One plain HTTP request: status and body text."""
    status, _, text = fetch_response(base, method, path, body, headers, timeout)
    return status, text


def fetch_response(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                   timeout: float = 60) -> tuple[int, dict, str]:
    """One plain HTTP request: status, headers (lower-case names) and body text."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


@contextmanager
def app_on_loopback(app):
    """Serve ``app`` with uvicorn on a helper thread, on a free port of 127.0.0.1; yield its base
    URL; stop it (bounded)."""
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 60)
        assert server.started, "server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until(condition, seconds: float = 30) -> None:
    """Poll ``condition`` until true; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextmanager
def running_server(command: list[str], env: dict | None = None, seconds: float = 300):
    """Start ``command --port P`` (P a free loopback port), wait until its /health answers 200
    (bounded), yield its base URL, and stop it."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # the server binds it next
    server = subprocess.Popen([*command, "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert server.poll() is None, server.stdout.read().decode()[-3000:]
        try:
            return fetch(base, "GET", "/health")[0] == 200
        except OSError:
            return False

    try:
        wait_until(up, seconds)
        yield base
    finally:
        stop_process(server, 60)


@contextmanager
def served_model(name: str, **app_options):
    """An Engine over zoo model ``name`` (``ENGINE_OPTIONS``) behind ``build_app(**app_options)`` on
    loopback: yields its ``base`` URL, an openai ``client``, the ``engine``, the ``tokenizer`` and
    the app's ``server`` state."""
    engine = flexpage.Engine(zoo.build(name), **ENGINE_OPTIONS)
    tokenizer = zoo.load_tokenizer(name)
    app = build_app(engine, tokenizer, name, **app_options)
    with app_on_loopback(app) as base:
        yield SimpleNamespace(base=base, engine=engine, tokenizer=tokenizer, server=app.state.server,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120))


PROBE = """
import http.client, json, signal, sys, time
host, port = sys.argv[1], int(sys.argv[2])
latencies, deadline = [], time.monotonic() + 600
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    while time.monotonic() < deadline:
        time.sleep(0.02)
        start = time.perf_counter()
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.request("GET", "/health")
        status = connection.getresponse().status
        latencies.append(time.perf_counter() - start if status == 200 else float("inf"))
        connection.close()
finally:
    print(json.dumps(latencies), flush=True)
"""


@contextmanager
def health_probe(base: str):
    """Time /health every 20 ms from another process (its own interpreter: only the server's
    threads share the server's) while the block runs; yields the list its latencies land in
    (seconds; inf for an answer other than 200) once the block ends."""
    host, port = base.removeprefix("http://").split(":")
    probe = subprocess.Popen([sys.executable, "-c", PROBE, host, port], stdout=subprocess.PIPE, text=True)
    latencies: list[float] = []
    try:
        time.sleep(0.3)  # the probe's interpreter starts
        yield latencies
    finally:
        probe.send_signal(signal.SIGTERM)
        out, _ = probe.communicate(timeout=30)
        latencies.extend(json.loads(out or "[]"))
