"""A fuzz pass over the request schema, black-box over HTTP (it holds however the server
parses): random and malformed JSON bodies and field values POSTed to /v1/completions and
/v1/chat/completions of an in-process server on a tiny model with a chat template. Never
a 5xx nor a dropped connection, every error OpenAI's error object, and afterwards no
worker left busy (as many requests at once as the server has worker threads are answered)
and /health shows every block free.

Bounded: 80 fuzzed requests on a model of 2 layers, at most 8 new tokens each."""

import contextlib
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("aiohttp")
pytest.importorskip("jinja2")

from base_model import GPTConfig  # noqa: E402
from conftest import byte_tokenizer, tiny_model  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.chat import ChatTemplate  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402
from test_serving_hostile import assert_answered_properly, json_values, wait_until_idle  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
LIMITS = Limits(max_sequences=8, max_prompt_tokens=256, max_new_tokens=8, max_waiting=32)
# ChatML-like, on the byte tokenizer: a turn ends at <|endoftext|>, its one special token
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@contextlib.contextmanager
def chat_server(template):
    """(base URL without /v1, engine) of a server on the tiny model with this template."""
    engine = Engine(tiny_model(CONFIG, seed=5), TOKENIZER, tokens_per_block=8, attention="gather",
                    limits=LIMITS)
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, "tiny", chat_template=template) as url:
            yield url.removesuffix("/v1"), engine
    finally:
        engine.stop()


def send(url, path, body, method="POST"):
    """(status, headers, body bytes) on a fresh connection; body: bytes."""
    host, port = url.split("//")[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def post(url, path, body):
    """(status, parsed JSON) of a POST of body as JSON (None: a GET)."""
    if body is None:
        status, _, data = send(url, path, None, "GET")
    else:
        status, _, data = send(url, path, json.dumps(body).encode())
    return status, json.loads(data)


@pytest.fixture(scope="module")
def server():
    with chat_server(ChatTemplate(TEMPLATE, TOKENIZER)) as running:
        yield running


contents = st.text(max_size=30) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"])}, optional={"text": st.text(max_size=8)}),
    max_size=3)
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot", ""]) | json_values,
    "content": contents | json_values, "name": st.text(max_size=5), "tool_calls": json_values})
COMMON = {  # each: a plausible value, or anything at all
    "model": st.sampled_from(["tiny", "gpt-4"]) | st.none(),
    "max_tokens": st.integers(-2, 12) | st.integers(), "n": st.integers(-1, 10),
    "temperature": st.floats(-1, 3) | st.sampled_from([float("nan"), float("inf")]),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 300), "seed": st.integers(),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(st.text("0123456789", max_size=4), st.integers(-200, 200), max_size=3),
    "user": st.text(max_size=5),
}
CHAT = {**COMMON, "messages": st.lists(message, max_size=4) | json_values,
        "max_completion_tokens": st.integers(-1, 12), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 25), "add_generation_prompt": st.booleans(),
        "response_format": json_values, "tools": json_values, "chat_template_kwargs": json_values}
COMPLETION = {**COMMON, "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 300), max_size=8),
              "logprobs": st.integers(-1, 6), "echo": st.booleans(), "suffix": st.text(max_size=3)}


def bodies(fields):
    return st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})


requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT).map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION).map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
              json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=40)),
)


def test_fuzzed_requests_get_a_proper_answer_and_leave_nothing_busy(server):
    url, engine = server

    @settings(max_examples=80, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests)
    def one(request):
        path, body = request
        assert_answered_properly(*send(url, path, body))
    one()
    wait_until_idle(engine)
    # no worker left busy: as many chat requests at once as asyncio has worker threads
    # (min(32, cores + 4)) are each answered
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})))
        for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [status for status, _ in answers] == [200] * 8
    wait_until_idle(engine)
    status, health = post(url, "/health", None)
    assert status == 200 and health["blocks_free"] == health["blocks_total"]
