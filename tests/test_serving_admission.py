"""Admission control (serving/admission.py, enforced by Engine.submit): a request past a
per-request limit is refused at once with HTTP 400 naming the limit, a full waiting queue
turns new requests away with HTTP 429 and Retry-After while /health still answers, and
whatever was refused queued nothing."""

import json
import threading
import urllib.request

import pytest

pytest.importorskip("aiohttp")

from base_model import GPTConfig  # noqa: E402
from conftest import byte_tokenizer, tiny_model  # noqa: E402
from serving.admission import Limits, Overloaded, RequestTooLarge  # noqa: E402
from serving.engine import Engine, SamplingParams  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
LIMITS = Limits(max_sequences=4, max_prompt_tokens=100, max_new_tokens=200, max_waiting=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=5)


def new_engine(model, limits=LIMITS):
    return Engine(model, TOKENIZER, tokens_per_block=8, attention="gather", limits=limits)


def post(url, body, timeout=60):
    """(status, headers, parsed JSON) of a POST to /v1/completions."""
    request = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def health(url):
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("body, code, words", [
    ({"prompt": ["a"] * 2000, "n": 128}, "too_many_sequences", "256,000 sequences (2,000 prompts x n = 128); "
                                                              "this server takes at most 4"),
    ({"prompt": ["a", "b", "c"], "n": 2}, "too_many_sequences", "at most 4 per request"),
    ({"prompt": [[1] * 60, [2] * 60]}, "too_many_prompt_tokens", "more than 100 tokens"),
    ({"prompt": ["a", "b"], "n": 2, "max_tokens": 51}, "too_many_tokens", "may generate 204 tokens"),
])
def test_a_request_past_a_limit_gets_400_naming_it_and_queues_nothing(model, body, code, words):
    engine = new_engine(model)  # not running: anything queued would stay there
    with BackgroundServer(engine, TOKENIZER, "tiny") as url:
        status, _, reply = post(url, body)
        assert status == 400 and reply["error"]["code"] == code and words in reply["error"]["message"]
        assert reply["error"]["type"] == "invalid_request_error"
        assert health(url)["waiting"] == 0 and not engine.has_work()


def test_a_full_queue_gets_429_with_retry_after_and_health_still_answers(model):
    engine = new_engine(model)
    with BackgroundServer(engine, TOKENIZER, "tiny") as url:
        replies = []
        waiting = [threading.Thread(target=lambda: replies.append(post(url, {
            "prompt": ["a", "b"], "n": 2, "max_tokens": 3}))) for _ in range(2)]
        for thread in waiting:  # 2 x 4 sequences: the queue's 8, and the engine is not running
            thread.start()
        while engine.num_waiting() < 8:
            threading.Event().wait(0.01)
        status, headers, reply = post(url, {"prompt": "c", "max_tokens": 3})
        assert status == 429 and headers["Retry-After"] == "1"
        assert reply["error"]["code"] == "server_busy" and "8 sequences are waiting" in reply["error"]["message"]
        assert health(url)["waiting"] == 8  # /health answers whatever the queue holds
        engine.start()  # the queue drains: the two waiting requests are served, the next one too
        try:
            for thread in waiting:
                thread.join(timeout=60)
            assert [r[0] for r in replies] == [200, 200]
            assert post(url, {"prompt": "c", "max_tokens": 3})[0] == 200
        finally:
            engine.stop()
    assert len(engine.pool.free) == engine.pool.num_blocks


def test_submit_is_all_or_nothing(model):
    engine = new_engine(model)
    params = SamplingParams(max_tokens=2)
    engine.submit([[1], [2]], [params] * 2)
    engine.submit([[3]], [params] * 3)  # 7 of the 8
    with pytest.raises(Overloaded):
        engine.submit([[1]], [params] * 2)  # 9 > 8: neither is queued
    assert engine.num_waiting() == 7
    with pytest.raises(RequestTooLarge, match="at most 4"):
        engine.submit([[1]] * 5, [params])
    with pytest.raises(RequestTooLarge, match="more than 100 tokens"):
        engine.submit([[1] * 50, [2] * 51], [params])
    assert engine.num_waiting() == 7
    engine.run_until_done()
    assert len(engine.pool.free) == engine.pool.num_blocks


@pytest.mark.parametrize("fields, words", [
    (dict(max_sequences=0), "max_sequences must be an integer >= 1"),
    (dict(max_waiting=10, max_sequences=20), "could never wait"),
])
def test_limits_that_cannot_work_are_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        Limits(**fields)


def test_an_ipv6_host_is_printed_in_brackets(model):
    try:
        with BackgroundServer(new_engine(model), TOKENIZER, "tiny", host="::1") as url:
            assert url.startswith("http://[::1]:") and health(url)["status"] == "ok"
    except OSError as e:  # no IPv6 on this machine (some containers): nothing to bind
        pytest.skip(f"no IPv6 loopback here ({e.strerror})")
