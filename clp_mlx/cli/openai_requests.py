"""OpenAI request bodies checked into one :class:`Request`, and OpenAI's
response and error shapes. Every bad field is a :class:`BadRequest` with the
HTTP status and the field it names; the server answers it and serves on."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from ..decode.sampling import Sampling
from ..errors import ClpError

MAX_STOPS = 4  # as OpenAI


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass
class Request:
    chat: bool
    prompt: str | list[int]  # text, or (chat) the messages under the template
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int


def _number(body, key, lo=None, hi=None, whole=False, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if whole else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not whole and not math.isfinite(value)):
        raise BadRequest(f"'{key}' must be {'an integer' if whole else 'a number'}", key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {value}", key)
    return value


def _bool(body, key) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false", key)
    return value


def parse(
    raw: bytes, chat: bool, model_ids: set[str], default_max: int, defaults: Sampling
) -> Request:
    """The request ``raw`` (a JSON body), checked; raises :class:`BadRequest`.
    Sampling fields left out take the server's flags (``defaults``), as in
    mlx_lm.server."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    if model is not None and model not in model_ids:
        raise BadRequest(f"the model {model!r} does not exist; this server has {sorted(model_ids)}",
                         "model", 404)  # fmt: skip
    prompt = _messages(body) if chat else _prompt(body)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadRequest("'n' must be 1: one answer per request", "n")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({key: limit}, key, 1, whole=True, default=default_max)
    seed = _number(body, "seed", 0, 2**63 - 1, whole=True)
    try:
        sampling = Sampling(
            _number(body, "temperature", 0, 2, default=defaults.temp),
            _number(body, "top_p", 0, 1, default=defaults.top_p) or 1.0,
            _number(body, "top_k", 0, whole=True, default=defaults.top_k),
            defaults.seed if seed is None else seed,
            _number(body, "min_p", 0, 0.999, default=defaults.min_p),
        )
    except ClpError as e:
        raise BadRequest(str(e)) from None
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' holds at most {MAX_STOPS} strings", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Request(
        chat, prompt, max_tokens, sampling, stops, _bool(body, "stream"),
        _bool(options, "include_usage"), _bool(body, "logprobs"),
        _number(body, "top_logprobs", 0, 20, whole=True, default=0),
    )  # fmt: skip


def _messages(body) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs a role: system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}]: only text content is supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(body) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string", "prompt")
    return prompt


def envelope(req: Request, model_id: str) -> dict:
    """What every response and chunk of one completion shares."""
    kind = "chat.completion" if req.chat else "text_completion"
    return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": kind, "created": int(time.time()), "model": model_id}  # fmt: skip


def usage(n_prompt: int, n_completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; ``cached``: prompt tokens a kept KV cache already held."""
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def choice(req: Request, text: str | None, reason: str | None, logprobs, delta: bool) -> dict:
    """One choice: a chat message or delta, or a completion's text."""
    out: dict = {"index": 0, "finish_reason": reason}
    if req.chat:
        key = "delta" if delta else "message"
        out[key] = {} if text is None else {"role": "assistant", "content": text}
        out["logprobs"] = {"content": logprobs} if req.logprobs and logprobs else None
    else:
        out["text"] = text or ""
        out["logprobs"] = None
    return out
