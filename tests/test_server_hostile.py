"""Hostile HTTP against the server: raw bytes no client library would send,
fields of the wrong shape, a body shorter than declared, and a client that
stops reading a stream. Each gets its 4xx (or its connection closed) and the
next good request is answered."""

import json
import socket
import time

import pytest
from server_helpers import MESSAGES, post, running, tiny_engine

from clp_mlx.cli.server import Handler

CHAT = "/v1/chat/completions"
NAN_TEMP = b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("server") / "tiny")


@pytest.fixture(scope="module")
def url(engine):
    with running(engine) as base:
        yield base


def raw_http(base: str, data: bytes, timeout: float = 30) -> bytes:
    """Send ``data`` as is; what the server sent back until it closed."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def request(method: str, path: str, body: bytes, length: object = "body") -> bytes:
    """Raw HTTP; ``length``: the Content-Length sent (the body's by default, None: none)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    length = len(body) if length == "body" else length
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return head.encode() + b"\r\n" + body


def served_on(base: str) -> None:
    code, reply = post(base + CHAT, {"messages": MESSAGES, "max_tokens": 2})
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "name,data,status",
    [
        ("array body", request("POST", CHAT, b"[1, 2]"), 400),
        ("body not UTF-8", request("POST", CHAT, b'{"m": "\xff\xfe"}'), 400),
        ("no Content-Length", request("POST", CHAT, b'{"messages": []}', None), 400),
        ("negative Content-Length", request("POST", CHAT, b"{}", -2), 400),
        ("Content-Length letters", request("POST", CHAT, b"{}", "two"), 400),
        ("Content-Length too big", request("POST", CHAT, b"{}", 1 << 40), 413),
        ("deep JSON", request("POST", CHAT, b"[" * 100000), 400),
        ("NaN temperature", request("POST", CHAT, NAN_TEMP), 400),
        ("unknown POST route", request("POST", "/v1/embeddings", b"{}"), 404),
        ("unknown GET route", request("GET", "/../../etc/passwd", b"", None), 404),
    ],
)
def test_raw_requests_get_their_status_and_the_server_serves_on(url, name, data, status):
    got = raw_http(url, data)
    assert got.startswith(f"HTTP/1.1 {status}".encode()), (name, got[:200])
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    served_on(url)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MESSAGES, "n": 2}, "n"),
        ({"messages": MESSAGES, "n": True}, "n"),
        ({"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": MESSAGES, "stream": True, "stream_options": [1]}, "stream_options"),
        ({"messages": MESSAGES, "seed": 2**64}, "seed"),
        ({"messages": MESSAGES, "top_p": float("inf")}, "top_p"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": MESSAGES, "model": ["tiny"]}, "model"),
    ],
)
def test_fields_of_the_wrong_shape_are_400s(url, body, param):
    code, reply = post(url + CHAT, body, raw=json.dumps(body, allow_nan=True).encode())
    assert code == 400 and reply["error"]["param"] == param, reply
    served_on(url)


def test_a_body_shorter_than_declared_is_dropped_when_the_client_leaves(url):
    got = raw_http(url, request("POST", CHAT, b'{"messages": ', 500))
    assert got == b""  # nothing to answer: the request never arrived whole
    served_on(url)


class QuickHandler(Handler):
    """The server's handler with a 1 s stall limit and a small send buffer,
    so that a client that stops reading stalls the writer within the test."""

    timeout = 1

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def test_a_client_that_stalls_mid_body_is_dropped_quietly(engine, capfd):
    with running(engine, QuickHandler) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(request("POST", CHAT, b'{"messages": ', 500))
            assert s.recv(100) == b""  # closed after the stall limit, no answer
        served_on(base)
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_stops_reading_is_dropped_and_the_next_is_served(engine):
    body = json.dumps({"messages": MESSAGES, "max_tokens": 20000, "stream": True}).encode()
    with running(engine, QuickHandler) as base:
        host, port = base.removeprefix("http://").split(":")
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect((host, int(port)))
        try:
            slow.sendall(request("POST", CHAT, body, len(body)))
            assert slow.recv(12) == b"HTTP/1.1 200"
            time.sleep(0.5)  # let the stream fill the buffers; then read no more
            # Without the stall limit this request would wait for the stalled
            # stream's 20000 tokens, which never drain: the client times out.
            code, reply = post(base + CHAT, {"messages": MESSAGES, "max_tokens": 3}, timeout=30)
            assert code == 200 and reply["usage"]["completion_tokens"] == 3
            assert engine.lock.acquire(timeout=30)  # the stalled generation was closed
            engine.lock.release()
        finally:
            slow.close()


def test_a_port_in_use_is_one_error_line(tmp_path):
    import subprocess
    import sys

    from conftest import tiny_model, write_model_folder

    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [sys.executable, "-m", "clp_mlx.server", "--model", str(folder), "--port", port]
        r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: cannot listen on 127.0.0.1:")
