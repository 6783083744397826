"""The HTTP API under hostile clients, on loopback against a tiny model:

  - a fuzz test (hypothesis) over request bodies (JSON of any shape, plausible requests
    with wrong values, raw bytes, deep nesting), headers (Content-Type, Content-Encoding,
    chunked or not) and encodings (gzip, deflate, garbage): never a 5xx, every error
    OpenAI's error object, never a dropped connection, no block held afterwards;
  - a soak test: many clients for a bounded time mixing valid, invalid, over-limit and
    abandoned requests: afterwards zero 5xx, zero blocks held, and the process's memory
    back within SOAK_MEMORY_BOUND of where it was after a warm-up round.

Bounded: ~150 fuzzed requests and 4 + 1 seconds of soak."""

import gzip
import http.client
import json
import random
import threading
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("aiohttp")

from base_model import GPTConfig  # noqa: E402
from conftest import byte_tokenizer, tiny_model  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
# small limits: a fuzzed max_tokens of 10**6 is refused at once rather than generated
LIMITS = Limits(max_sequences=8, max_prompt_tokens=256, max_new_tokens=64, max_waiting=32)
SOAK_SECONDS, SOAK_CLIENTS = 4.0, 12
SOAK_MEMORY_BOUND = 32 << 20  # resident memory the soak may leave behind (measured: +1 to +2 MiB)


@pytest.fixture(scope="module")
def server():
    """(host, port, engine)"""
    engine = Engine(tiny_model(CONFIG, seed=5), TOKENIZER, tokens_per_block=8, attention="gather",
                    limits=LIMITS)
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, "tiny") as url:
            host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
            yield host, int(port), engine
    finally:
        engine.stop()


def send(server, method, path, body=b"", headers=None, chunked=False):
    """(status, headers, body bytes) of one request on a fresh connection; a dropped
    connection raises (http.client.RemoteDisconnected, ConnectionResetError)."""
    host, port, _ = server
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        if chunked:
            connection.request(method, path, body=iter([body[:7], body[7:]]), headers=headers or {},
                               encode_chunked=True)
        else:
            connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def assert_answered_properly(status, headers, data):
    """No 5xx; an error is OpenAI's error object; a success is a completion (or its stream)."""
    assert status < 500, data[:300]
    if status >= 400:
        assert headers["Content-Type"].startswith("application/json"), data[:300]
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif headers["Content-Type"].startswith("text/event-stream"):
        assert data.startswith(b"data: {") and data.endswith(b"data: [DONE]\n\n"), data[-300:]
    else:
        json.loads(data)


def wait_until_idle(engine, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        h = engine.stats()
        if h["running"] == h["waiting"] == 0 and h["blocks_free"] == h["blocks_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {engine.stats()}")


# ---------------------------------------------------------------------------- the fuzz test

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
small_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=12)
FIELDS = {  # each: a plausible value, or anything at all
    "prompt": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=10) | small_ids
    | st.lists(small_ids, max_size=3),
    "max_tokens": st.integers(-2, 40) | st.integers(),
    "n": st.integers(-1, 10),
    "temperature": st.floats(-1, 3) | st.sampled_from([float("nan"), float("inf")]),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 300), "seed": st.integers(),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "model": st.sampled_from(["tiny", "gpt-4"]), "logprobs": st.integers(0, 3), "echo": st.booleans(),
}
requests = st.fixed_dictionaries({}, optional={name: value | json_values for name, value in FIELDS.items()})


def deep(k):
    return b"[" * k + b"]" * k


bodies = st.one_of(
    requests.map(lambda r: json.dumps(r).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.integers(1, 3000).map(deep),
    st.just(b'{"prompt": "caf\xe9"}'),   # not UTF-8
    st.just(b'{"prompt": "\\ud800", "max_tokens": 1}'),
)
ENCODINGS = {"identity": lambda b: b, "gzip": gzip.compress, "deflate": zlib.compress,
             "garbage": lambda b: b"\x1f\x8b" + b}
content_encodings = st.sampled_from([None, "identity", "gzip", "deflate", "br", "zstd", "x-custom", "gzip, br"])
content_types = st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
ROUTES = [("POST", "/v1/completions")] * 8 + [("GET", "/health"), ("GET", "/v1/models"),
                                              ("POST", "/v1/models"), ("PUT", "/v1/completions"),
                                              ("DELETE", "/health"), ("POST", "/v1/nothing"),
                                              ("GET", "/v1/cache"), ("POST", "/"), ("POST", "/web/page.js")]


def test_fuzzed_requests_get_a_proper_answer_and_leak_nothing(server):
    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(route=st.sampled_from(ROUTES), body=bodies, transform=st.sampled_from(list(ENCODINGS)),
           content_encoding=content_encodings, content_type=content_types, chunked=st.booleans())
    def one(route, body, transform, content_encoding, content_type, chunked):
        headers = {k: v for k, v in (("Content-Encoding", content_encoding),
                                      ("Content-Type", content_type)) if v is not None}
        assert_answered_properly(*send(server, *route, ENCODINGS[transform](body), headers, chunked))
    one()
    wait_until_idle(server[2])


# ---------------------------------------------------------------------------- the soak test

def resident_bytes():
    """This process's resident memory (Linux's /proc; the soak's server runs in it)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def completion(**fields):
    return json.dumps({"prompt": "Once", "max_tokens": 12, "ignore_eos": True, **fields}).encode()


def abandon(server, body, read_first_line):
    """Send a request and leave: after the first event of a stream, or before any answer."""
    host, port, _ = server
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    if read_first_line:
        response = connection.getresponse()
        if response.status == 200:
            response.readline()
    connection.close()


SOAK_MIX = [  # (kind, what a client does)
    ("valid", lambda s, rng: send(s, "POST", "/v1/completions", completion(n=rng.randint(1, 3)))),
    ("stream", lambda s, rng: send(s, "POST", "/v1/completions", completion(stream=True, prompt=["a", "bb"]))),
    ("invalid", lambda s, rng: send(s, "POST", "/v1/completions", rng.choice(
        [b"{", deep(2000), completion(top_p=0), completion(prompt="x" * 500), gzip.compress(completion())]),
        {"Content-Encoding": "gzip"} if rng.random() < 0.3 else {})),
    ("over limit", lambda s, rng: send(s, "POST", "/v1/completions", completion(prompt=["a"] * 5, n=2))),
    ("abandoned stream", lambda s, rng: abandon(s, completion(stream=True, max_tokens=64), True)),
    ("abandoned", lambda s, rng: abandon(s, completion(max_tokens=64), False)),
    ("health", lambda s, rng: send(s, "GET", "/health")),
]


def soak(server, seconds, seed):
    """SOAK_CLIENTS threads, each sending requests of SOAK_MIX's kinds at random until the
    time is up; returns {kind: [status, ...]} (None for an abandoned request)."""
    statuses, lock = {kind: [] for kind, _ in SOAK_MIX}, threading.Lock()
    failures = []
    deadline = time.monotonic() + seconds

    def client(i):
        rng = random.Random(seed * 1000 + i)
        try:
            while time.monotonic() < deadline:
                kind, act = rng.choice(SOAK_MIX)
                answer = act(server, rng)
                if answer is not None:
                    assert_answered_properly(*answer)
                with lock:
                    statuses[kind].append(answer and answer[0])
        except Exception as e:  # a 5xx, a malformed answer, a dropped connection
            failures.append(e)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(SOAK_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    return statuses


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from Linux's /proc")
def test_soak_many_clients_valid_invalid_and_abandoned(server):
    engine = server[2]
    soak(server, 1.0, seed=0)  # warm-up: the allocator's pools, aiohttp's and torch's caches
    wait_until_idle(engine)
    before = resident_bytes()
    statuses = soak(server, SOAK_SECONDS, seed=1)
    wait_until_idle(engine)
    grown = resident_bytes() - before
    every = [s for kind in statuses.values() for s in kind if s is not None]
    assert statuses["valid"] and statuses["abandoned stream"] and statuses["invalid"]
    assert max(every) < 500 and set(statuses["valid"]) <= {200, 429}
    assert set(statuses["over limit"]) == {400} and set(statuses["invalid"]) <= {400, 415}
    assert grown < SOAK_MEMORY_BOUND, f"resident memory grew by {grown / 2**20:.1f} MiB"
    print(f"soak: {len(every)} answered, {sum(len(v) for v in statuses.values())} requests, "
          f"memory {grown / 2**20:+.1f} MiB")
