"""``python -m clp_mlx.server``: an OpenAI-compatible HTTP server, in
``mlx_lm.server``'s shape (the standard library's ``http.server``, as mlx-lm:
no web framework to install, and one model serves one request at a time).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``. Streaming is server-sent events in
OpenAI's chunk format. Each completion carries, beside OpenAI's fields,
``clp_mlx``: the decode mode, tokens per backbone pass and drafts accepted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..api import stream_generate
from ..errors import ClpError
from ..model.backbone import context_length
from ..model.tokens import check_text, encode
from .args import add_decode_args, add_model_args, decode_config, load_model, parser, run
from .openai_requests import BadRequest, Request, choice, envelope, parse, usage
from .prompt import render
from .prompt_caches import PromptCaches

MAX_BODY = 4 << 20  # bytes


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser("python -m clp_mlx.server", "An OpenAI-compatible server.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0: any free one)")
    p.add_argument(
        "--prompt-cache-size", type=int, default=4,
        help="KV caches kept for requests that extend earlier ones (default: 4; 0: none)",
    )  # fmt: skip
    add_decode_args(p, max_tokens=512, seed=None)
    return p


class Engine:
    """The model and how it decodes; one generation at a time."""

    def __init__(self, model, tokenizer, heads, config, model_id: str, cache_size: int = 4):
        self.model, self.tokenizer, self.heads, self.config = model, tokenizer, heads, config
        self.model_id, self.lock = model_id, threading.Lock()
        self.caches = PromptCaches(model, cache_size, heads)
        self.cached = 0  # how many prompt tokens the last request found in a kept cache

    def prompt_ids(self, req: Request) -> list[int]:
        """The request's token ids: the chat under the template (as generate
        renders it), or the text; text UTF-8 cannot carry, or a template that
        refuses the messages, is a 400."""
        try:
            if req.chat:
                if self.tokenizer.chat_template is None:
                    raise BadRequest("this model has no chat template: use /v1/completions")
                for i, m in enumerate(req.prompt):
                    check_text(m["content"], f"messages[{i}].content")
                text = render(self.tokenizer, req.prompt, False, {})
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = encode(self.tokenizer, req.prompt)
        except ClpError as e:
            raise BadRequest(str(e), "messages" if req.chat else "prompt") from None
        limit = context_length(self.model)
        if limit is not None and len(ids) + req.max_tokens > limit:
            where = "messages" if req.chat else "prompt"
            raise BadRequest(
                f"the prompt's {len(ids)} tokens and max_tokens {req.max_tokens} "
                f"exceed the context of {limit} tokens",
                where,
            )
        return ids

    def events(self, req: Request, ids: list[int]):
        """(text, logprobs entries, finish reason or None, last response) per piece of text."""
        config = replace(self.config, max_tokens=req.max_tokens, sampling=req.sampling)
        hold = max((len(s) for s in req.stop), default=1) - 1
        text, sent, entries = "", 0, []
        cache, self.cached = self.caches.take(ids)
        tokens = list(ids)  # what the cache holds at the end: the prompt and the answer
        responses = stream_generate(
            self.model, self.tokenizer, ids[self.cached :], self.heads, config=config,
            prompt_cache=cache, context=ids[: self.cached],
        )  # fmt: skip
        try:
            for r in responses:
                tokens.append(r.token)
                text += r.text
                if req.logprobs and r.logprobs is not None and r.finish_reason != "stop":
                    entries.append(self._logprob(r.token, r.logprobs, req.top_logprobs))
                cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
                if cut >= 0:
                    yield text[sent:cut], entries, "stop", r
                    return
                if r.finish_reason is not None:
                    yield text[sent:], entries, r.finish_reason, r
                    return
                end = max(sent, len(text) - hold)
                if end > sent or entries:
                    yield text[sent:end], entries, None, r
                    sent, entries = end, []
        finally:
            responses.close()  # a client gone mid-stream stops the generation
            self.caches.give_back(cache, tokens)

    def _logprob(self, token: int, logprobs, top: int) -> dict:
        import mlx.core as mx

        def entry(t, lp):
            piece = self.tokenizer.decode([t])
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

        out = entry(token, logprobs[token].item())
        best = mx.argpartition(-logprobs, top - 1)[:top].tolist() if top else []  # no full sort
        out["top_logprobs"] = sorted(
            (entry(t, logprobs[t].item()) for t in best), key=lambda e: -e["logprob"]
        )
        return out


def statistics(r) -> dict:
    s = r.stats
    return {"mode": s.mode, "tokens_per_pass": round(s.tokens_per_step, 3),
            "drafts_accepted": sum(n * c for n, c in enumerate(s.accepted)),
            "passes": s.steps, "generation_tps": round(r.generation_tps, 2)}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    engine: Engine  # set on the subclass serve() makes
    protocol_version = "HTTP/1.1"
    # A client that sends or reads nothing for this long is dropped: one that
    # stops reading a stream would otherwise hold the model from everyone.
    timeout = 60

    def log_message(self, format, *args):
        pass  # quiet, as a library; errors go to the client

    def do_GET(self):
        if self.path == "/health":
            return self._json(200, {"status": "ok"})
        if self.path == "/v1/models":
            model = {
                "id": self.engine.model_id,
                "object": "model",
                "created": 0,
                "owned_by": "clp-mlx",
            }
            return self._json(200, {"object": "list", "data": [model]})
        self._json(404, BadRequest(f"no route GET {self.path}", status=404).body())

    def do_POST(self):
        routes = {"/v1/chat/completions": True, "/v1/completions": False}
        if self.path not in routes:
            return self._json(404, BadRequest(f"no route POST {self.path}", status=404).body())
        engine = self.engine
        try:
            raw = self._body()
            if raw is None:
                return  # the client stalled or left while sending its body
            ids_ok = {engine.model_id, "default"}
            req = parse(
                raw, routes[self.path], ids_ok, engine.config.max_tokens, engine.config.sampling
            )
            ids = engine.prompt_ids(req)
        except BadRequest as e:
            return self._json(e.status, e.body())
        with engine.lock:
            self._stream(req, ids) if req.stream else self._whole(req, ids)

    def _body(self) -> bytes | None:
        """The request's body, or None when the client sent less than it
        declared (the connection is closed); a bad Content-Length is a 4xx."""
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("Content-Length must be a number") from None
        if not 0 < size <= MAX_BODY:
            raise BadRequest(f"a body of 1 to {MAX_BODY} bytes is needed (Content-Length)",
                             status=413 if size > MAX_BODY else 400)  # fmt: skip
        try:
            raw = self.rfile.read(size)
        except (TimeoutError, ConnectionError):
            raw = b""
        if len(raw) < size:
            self.close_connection = True
            return None
        return raw

    def _whole(self, req: Request, ids: list[int]):
        text, entries, reason, last = "", [], "length", None
        for piece, got, reason, last in self.engine.events(req, ids):
            text += piece
            entries += got
        n = last.generation_tokens if last is not None else 0
        body = {**envelope(req, self.engine.model_id),
                "choices": [choice(req, text, reason, entries, delta=False)],
                "usage": usage(len(ids), n, self.engine.cached),
                "clp_mlx": statistics(last)}  # fmt: skip
        self._json(200, body)

    def _stream(self, req: Request, ids: list[int]):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        head = envelope(req, self.engine.model_id)
        if req.chat:
            head["object"] = "chat.completion.chunk"
        try:
            for piece, got, reason, last in self.engine.events(req, ids):
                chunk = {**head, "choices": [choice(req, piece, reason, got, delta=True)]}
                if reason is not None:
                    chunk["clp_mlx"] = statistics(last)
                self._event(chunk)
            if req.include_usage:
                self._event(
                    {
                        **head,
                        "choices": [],
                        "usage": usage(len(ids), last.generation_tokens, self.engine.cached),
                    }
                )
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client left or stalled: events() closed the run

    def _event(self, data: dict):
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(engine: Engine, host: str, port: int, handler=None) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (not yet serving: call serve_forever);
    ``handler``: a :class:`Handler` subclass, to change its socket settings."""
    handler = type("BoundHandler", (handler or Handler,), {"engine": engine})
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise ClpError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        raise ClpError(f"--port must be in 0..65535, got {args.port}")
    if args.prompt_cache_size < 0:
        raise ClpError(f"--prompt-cache-size must be 0 or more, got {args.prompt_cache_size}")
    config = decode_config(args)
    model, tokenizer, heads, resolved = load_model(args, config)
    engine = Engine(
        model, tokenizer, heads, resolved, args.model or "default", args.prompt_cache_size
    )
    server = serve(engine, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {engine.model_id} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
