"""Loopback HTTP helpers shared by the server tests (stdlib only)."""

import http.client
import socket
import time


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
