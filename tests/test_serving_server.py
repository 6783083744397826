"""The OpenAI-compatible server (serving/server.py, serve.py): the official openai client
against a server started here on 127.0.0.1, raw HTTP for every kind of bad request, a
client that leaves mid-stream, and serve.py as a command."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from base_model import GPTConfig  # noqa: E402
from conftest import NO_BACKGROUND_BUILD, ROOT, byte_tokenizer, tiny_model  # noqa: E402
from generation.loop import generate_tokens  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
NAME = "tiny"


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=5)


@pytest.fixture(scope="module")
def server(model):
    """(base url ending in /v1, engine)"""
    engine = Engine(model, TOKENIZER, tokens_per_block=8)
    engine.start()  # serve.py runs the engine on its main thread; here pytest has that
    try:
        # past the context as the generation loop goes (the streams below run for long)
        with BackgroundServer(engine, TOKENIZER, NAME, context_policy="reprefill") as url:
            yield url, engine
    finally:
        engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=60)


def greedy_alone(model, text, n):
    ids = TOKENIZER.encode_ordinary(text)
    out = generate_tokens(model, [ids], n, temperature=0, vocab_limit=TOKENIZER.n_vocab)
    return TOKENIZER.decode(out[0].tolist())


def post(url, body, raw=False):
    """(status, parsed JSON) of a POST to /v1/completions."""
    data = body if raw else json.dumps(body).encode()
    request = urllib.request.Request(url + "/completions", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url):
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as response:
        return json.loads(response.read())


def wait_until_idle(url, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        h = health(url)
        if h["running"] == h["waiting"] == 0 and h["blocks_free"] == h["blocks_total"]:
            return h
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {health(url)}")


def test_completion_equals_greedy_generation_alone(client, model, server):
    r = client.completions.create(model=NAME, prompt=["Hello", "The quick brown fox"],
                                  max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.choices[0].text == greedy_alone(model, "Hello", 20)
    assert r.choices[1].text == greedy_alone(model, "The quick brown fox", 20)
    assert r.usage.prompt_tokens == 5 + 19 and r.usage.completion_tokens == 40
    assert client.models.list().data[0].id == NAME
    wait_until_idle(server[0])


def test_streaming_gives_the_same_text_in_pieces(client, model):
    stream = client.completions.create(model=NAME, prompt="Once", max_tokens=30, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 5 and "".join(pieces) == greedy_alone(model, "Once", 30)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 30


def test_streamed_events_that_are_ready_together_go_out_in_one_write(client, monkeypatch):
    # n=4 greedy choices of one prompt, and a slow network: each write takes 0.2 s, while
    # the engine makes a step in milliseconds, so events queue up behind a write and the
    # next write takes every one that is ready
    import asyncio
    from aiohttp import web
    writes = []
    write = web.StreamResponse.write

    async def counted(self, data):
        writes.append(data.count(b"data: "))
        await asyncio.sleep(0.2)
        return await write(self, data)
    monkeypatch.setattr(web.StreamResponse, "write", counted)
    stream = client.completions.create(model=NAME, prompt="Once", max_tokens=20, n=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert len(set(texts)) == 1 and len(texts[0]) > 0  # greedy: four times the same text
    assert sum(writes) == len(chunks) + 1  # every event written once, [DONE] included
    assert len(writes) < len(chunks) / 2


def test_n_samples_with_a_seed_are_different_and_reproducible(client):
    def draw(seed):
        r = client.completions.create(model=NAME, prompt="abc", max_tokens=15, n=3, seed=seed,
                                      temperature=1.0, extra_body={"top_k": 50, "ignore_eos": True})
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    first = draw(11)
    assert len(set(first)) == 3 and draw(11) == first and draw(12) != first


def test_stop_strings_end_the_text(client, model):
    whole = greedy_alone(model, "Stop", 30)
    stop = whole[12:14]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt="Stop", max_tokens=30, temperature=0,
                                      stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole[:whole.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    (b"not json", None, None),
    (b"[1, 2]", None, None),
    ({"model": NAME}, "prompt", "missing_required_parameter"),
    ({"prompt": 42}, "prompt", "invalid_type"),
    ({"prompt": []}, "prompt", "invalid_type"),
    ({"prompt": [[1, 2], "mixed", 3]}, "prompt", "invalid_type"),
    ({"prompt": [1, 999999]}, "prompt", "invalid_value"),
    ({"prompt": "x" * 65}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "model": "gpt-4"}, "model", "model_not_found"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "temperature": True}, "temperature", "invalid_type"),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "invalid_value"),
    ({"prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"prompt": "x", "top_k": -2}, "top_k", "invalid_value"),  # 0 and -1 are off
    ({"prompt": "x", "n": 0}, "n", "invalid_value"),
    ({"prompt": "x", "n": 1.5}, "n", "invalid_type"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "invalid_type"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"prompt": "x", "seed": "7"}, "seed", "invalid_type"),
    ({"prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"prompt": "x", "stream_options": []}, "stream_options", "invalid_type"),
    ({"prompt": "x", "best_of": 2}, "best_of", "unsupported_parameter"),
]


@pytest.mark.parametrize("body,param,code", BAD_REQUESTS)
def test_bad_requests_get_400_and_an_openai_error(server, body, param, code):
    status, reply = post(server[0], body, raw=isinstance(body, bytes))
    assert status == 400
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_unknown_paths_get_an_error_object_and_the_server_lives_on(server, client):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server[0] + "/nothing", timeout=30)
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).choices


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    url, engine = server
    host, port = url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": NAME, "prompt": ["x" * 40, "y"], "max_tokens": 10_000, "stream": True,
            "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert health(url)["running"] == 2
    connection.close()  # gone mid-stream, 9,999 tokens early
    h = wait_until_idle(url)
    assert h["blocks_free"] == engine.pool.num_blocks


def run_serve(*args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **NO_BACKGROUND_BUILD}
    return subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_serve_py_serves_a_checkpoint_and_stops_on_ctrl_c(tiny_ckpt):
    process = run_serve("--ckpt", str(tiny_ckpt), "--port", "0", "--device", "cpu",
                        "--context-policy", "reprefill")
    try:
        for line in process.stderr:  # 'serving NAME on http://127.0.0.1:PORT/v1 (...)'
            if line.startswith("serving "):
                url = line.split()[3]
                break
        else:
            raise AssertionError("serve.py ended without serving")
        page = next(process.stderr)  # 'the page, to chat and watch the KV cache: http://...'
        with urllib.request.urlopen(page.split()[-1], timeout=60) as response:
            assert b'src="/web/page.js"' in response.read()
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="kvcache-gpt", prompt="Hi", max_tokens=3)
        assert len(r.choices) == 1 and r.usage.completion_tokens <= 3
        # Ctrl-C with a stream still running: it ends with an error event, and soon
        stream = client.completions.create(model="kvcache-gpt", prompt="Hi", max_tokens=10**6,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        assert process.wait(timeout=10) == 130
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--tokens-per-block", "0"], "--tokens-per-block"),
    (["--num-blocks", "1"], "--num-blocks"),
])
def test_serve_py_bad_flags_exit_2_with_one_line(tiny_ckpt, args, message):
    process = run_serve("--ckpt", str(tiny_ckpt), "--device", "cpu", *args)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 2 and message in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_the_benchmarks_load_test_against_a_running_server(server):
    """python -m benchmarks.serving --url: the load test alone, against a server already up."""
    from benchmarks.serving import run_url
    url, engine = server
    requests = [(0.0, [65, 66, 67], 5), (0.01, [70] * 10, 8), (0.02, [71], 1)]  # (at, prompt, n)
    result = run_url(url, requests)
    assert result["output_tokens"] == 5 + 8 + 1 and result["errors"] == 0
    assert result["leaked_blocks"] == 0 and result["preemptions"] == 0
    assert result["ttft_p50_ms"] > 0
    from plumbing.script import UserError
    with pytest.raises(UserError, match="should end in /v1"):  # one line, exit 2 for a user
        run_url(url.removesuffix("/v1"), requests)


def test_hand_out_sends_a_pass_at_a_time_and_waits_for_the_sends():
    """HandOut from another thread (the engine's): items put during a pass reach no queue
    before flush; flush wakes the loop once for them all, every item reaches its queue in
    the order put, and flush returns once the streams they woke have run (each consumer has
    taken its items), so the engine steps again with the interpreter lock to itself. The
    wait's bound is raised here: a slow machine must not turn the check into a race."""
    import asyncio
    import threading

    from serving.server import HandOut
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    wakeups, got, consumers = [], [[], []], []
    real = loop.call_soon_threadsafe

    def counted(callback, *args):
        if getattr(callback, "__name__", "") == "drain":  # not run_coroutine_threadsafe's
            wakeups.append(1)
        return real(callback, *args)

    async def consume(i, queue):
        while True:
            got[i].append(await queue.get())

    async def start_consumers():
        queues = [asyncio.Queue(), asyncio.Queue()]
        consumers.extend(asyncio.ensure_future(consume(i, queue)) for i, queue in enumerate(queues))
        return queues

    async def stop_consumers():
        for task in consumers:
            task.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)

    def a_pass(hand_out, queues, steps):
        for step in steps:  # a step: one item for each of the two streams
            for i, queue in enumerate(queues):
                hand_out.put(loop, queue, (i, step))
    loop.call_soon_threadsafe = counted
    try:
        queues = asyncio.run_coroutine_threadsafe(start_consumers(), loop).result(timeout=10)
        hand_out = HandOut()
        hand_out.SEND_WAIT_S = 60
        a_pass(hand_out, queues, range(200))
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result(timeout=10)
        assert got == [[], []] and wakeups == []  # put, not yet handed to the loop
        hand_out.flush()
        assert got == [[(i, step) for step in range(200)] for i in range(2)]
        assert len(wakeups) == 1  # 400 items, one wake-up
        a_pass(hand_out, queues, range(200, 210))
        hand_out.flush()
        assert got == [[(i, step) for step in range(210)] for i in range(2)]
        assert len(wakeups) == 2
        hand_out.flush()  # nothing put: nothing to wake the loop for
        assert len(wakeups) == 2
    finally:
        loop.call_soon_threadsafe = real
        asyncio.run_coroutine_threadsafe(stop_consumers(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    a_pass(hand_out, queues, range(3))
    hand_out.flush()  # the loop closed (a server shutting down): no error, no wait
