"""What the server tests share: a tiny model with a chat template behind a
running server, and a plain HTTP POST that returns (status, JSON body)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

from conftest import tiny_model, write_model_folder

from clp_mlx import api
from clp_mlx.cli.server import Engine, serve
from clp_mlx.decode.config import DecodeConfig

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "abcabc"}]


def tiny_engine(folder) -> Engine:
    folder = write_model_folder(folder, tiny_model(0))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    model, tokenizer, heads = api.load_with_drafter(folder, "init")
    config = DecodeConfig(max_tokens=16).resolve(model, heads)
    return Engine(model, tokenizer, heads, config, "tiny")


@contextmanager
def running(engine: Engine, handler=None):
    """The server's base URL while it serves on a free port."""
    server = serve(engine, "127.0.0.1", 0, handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        with engine.lock:  # no generation left running on a handler thread at exit
            server.server_close()


def post(url, body, raw=None, timeout=60):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
