"""The OpenAI-compatible server on a tiny model, with the official ``openai``
client: answers equal ``generate()``'s, streaming and not; usage counts;
bad requests get OpenAI-style 4xx errors and the server serves on."""

import json
import threading

import pytest
from server_helpers import MESSAGES, post, running, tiny_engine

from clp_mlx import api

openai = pytest.importorskip("openai", reason="the openai client is a test extra")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("server") / "tiny")
    with running(engine) as url:
        yield url, engine.model, engine.tokenizer, engine.heads


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def expected(served, messages=MESSAGES, max_tokens=16):
    _, model, tokenizer, heads = served
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return api.generate(model, tokenizer, ids, heads, max_tokens=max_tokens)


def test_chat_equals_generate_streaming_or_not(served, client):
    want = expected(served)
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 16 and got.usage.prompt_tokens > 0
    assert got.model_extra["clp_mlx"]["mode"] == "verify"
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 16


def test_completions_models_and_logprobs(served, client):
    _, model, tokenizer, heads = served
    got = client.completions.create(model="tiny", prompt="abab", max_tokens=8, temperature=0)
    assert got.choices[0].text == api.generate(model, tokenizer, "abab", heads, max_tokens=8)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)  # greedy: the best one


def test_stop_strings_cut_the_answer(served, client):
    want = expected(served)
    stop = want[3:5]
    got = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert got.choices[0].message.content == want[: want.find(stop)]
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body,raw,status,param",
    [
        (None, b"{not json", 400, None),
        ({"messages": []}, None, 400, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, None, 400, "messages"),
        ({"messages": MESSAGES, "max_tokens": 0}, None, 400, "max_tokens"),
        ({"messages": MESSAGES, "max_tokens": "many"}, None, 400, "max_tokens"),
        ({"messages": MESSAGES, "temperature": -1}, None, 400, "temperature"),
        ({"messages": MESSAGES, "model": "gpt-4"}, None, 404, "model"),
        ({"messages": MESSAGES, "stop": [1]}, None, 400, "stop"),
        ({"messages": MESSAGES, "max_tokens": 10**9}, None, 400, "messages"),  # past the context
        ({"messages": [{"role": "user", "content": "\ud800"}]}, None, 400, "messages"),  # no UTF-8
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_serves_on(served, body, raw, status, param):
    url = served[0] + "/v1/chat/completions"
    code, reply = post(url, body, raw)
    assert code == status and reply["error"]["param"] == param and reply["error"]["message"]
    code, reply = post(url, {"messages": MESSAGES, "max_tokens": 2})
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


def test_text_and_templates_the_tokenizer_refuses_are_400s(served):
    code, reply = post(served[0] + "/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2})
    assert code == 400 and reply["error"]["param"] == "prompt"
    _, _, tokenizer, _ = served
    old = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    try:
        code, reply = post(served[0] + "/v1/chat/completions", {"messages": MESSAGES})
    finally:
        tokenizer.chat_template = old
    assert code == 400 and "no system messages" in reply["error"]["message"]
    code, reply = post(served[0] + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert code == 200


def test_concurrent_clients_each_get_their_own_whole_answer(served):
    url = served[0] + "/v1/chat/completions"
    prompts = [f"{'ab' * (i + 1)}c" for i in range(8)]
    wants = {p: expected(served, [{"role": "user", "content": p}], 6) for p in prompts}
    errors, answers = [], []

    def client(p):
        for _ in range(5):
            code, reply = post(
                url,
                {"messages": [{"role": "user", "content": p}], "max_tokens": 6, "temperature": 0},
            )
            if code != 200:
                errors.append((p, code, reply))
            else:
                answers.append((p, reply["choices"][0]["message"]["content"]))

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(answers) == 40
    assert all(text == wants[p] for p, text in answers)  # none mixed with another's


def test_a_client_gone_mid_stream_does_not_stop_the_server(served):
    import socket
    from urllib.parse import urlparse

    where = urlparse(served[0])
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4000, "stream": True}).encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode() + body)
        assert s.recv(200).startswith(b"HTTP/1.1 200")
    code, reply = post(served[0] + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    assert code == 200 and reply["usage"]["completion_tokens"] == 3


def test_a_second_turn_prefills_only_its_new_tokens(served, client):
    first = [{"role": "user", "content": "xyzzy plugh"}]
    one = client.chat.completions.create(model="tiny", messages=first, max_tokens=8, temperature=0)
    _, _, tokenizer, _ = served
    n_first = len(tokenizer.apply_chat_template(first, add_generation_prompt=True))
    assert one.usage.prompt_tokens_details.cached_tokens < n_first - 2  # the template's start only
    answer = one.choices[0].message.content
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "again"},
    ]
    two = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0)
    # the first turn's prompt and (most of) its answer came from the kept cache
    assert two.usage.prompt_tokens_details.cached_tokens >= n_first
    assert two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
    assert two.choices[0].message.content == expected(served, second, 8)  # and nothing changed
