"""Loopback HTTP helpers shared by the server tests (stdlib only)."""

import http.client
import socket
import subprocess
import time
from contextlib import contextmanager

from flexpage.bench.measure import stop_process


def free_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def fetch(base: str, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
    """One plain HTTP request: status and body text."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(method, path, body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


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
