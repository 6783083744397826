"""Hostile inputs that were silently wrong or slow, each now one clear line or answer:

  - SIGTERM (what docker stop, systemd and Kubernetes send) stops serve.py as Ctrl-C does:
    every stream ends with an error event, then the process ends by SIGTERM; a second
    signal ends it at once;
  - "model": null is the model served (as vLLM), on every endpoint;
  - stop strings longer in all than a context can hold are a 400 naming 'stop', and their
    matching table is built once per request, not once per sample;
  - Hugging Face directories whose shards, config or tokenizer cannot mean what they say
    are refused in one line naming the file or the field."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, byte_tokenizer

TOKENIZER = byte_tokenizer()


# ---------------------------------------------------------------------------- SIGTERM

def start_serve(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # 'serving NAME on http://127.0.0.1:PORT/v1 (...)'
        if line.startswith("serving "):
            return process, line.split()[3]
    process.kill()
    raise AssertionError("serve.py ended without serving")


def test_sigterm_ends_every_stream_with_an_error_then_the_process_by_sigterm(tiny_ckpt):
    pytest.importorskip("aiohttp")
    process, url = start_serve("--ckpt", str(tiny_ckpt), "--port", "0", "--device", "cpu",
                               "--attention", "gather", "--context-policy", "reprefill")
    try:
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Hi", "max_tokens": 10**6, "stream": True, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rest = response.read()  # to the stream's last chunk: a cut stream raises IncompleteRead
        events = [line.removeprefix(b"data: ") for line in rest.splitlines() if line]
        error = json.loads(events[-1])["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        # death by SIGTERM, as the shell reports it: status 143 (128 + 15)
        assert process.wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - sent < 10
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()


FAKE_ENGINE = """
import sys, time
import serve

class DeafEngine:  # a step that never ends: only a second signal can end the process
    def run(self):
        print("running", flush=True)
        while True:
            time.sleep(0.01)

    def stop(self):
        pass

serve.run_until_stopped(DeafEngine())
"""


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_ends_the_process_at_once(first):
    process = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "running\n"
        process.send_signal(first)
        time.sleep(0.2)  # the first has been handled: the engine was asked to stop
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == -signal.SIGTERM
    finally:
        process.kill()


# ---------------------------------------------------------------------------- model: null

def test_model_null_is_the_model_served_on_every_endpoint():
    from serving.admission import Limits
    from serving.request_parsing import (BadRequest, parse_chat, parse_completion, parse_detokenize,
                                         parse_tokenize)
    parsed = parse_completion({"model": None, "prompt": "Hi"}, TOKENIZER, 64, "tiny", Limits())
    assert parsed.prompts == [list(b"Hi")]
    assert parse_tokenize({"model": None, "prompt": "Hi"}, TOKENIZER, 64, "tiny", None) == list(b"Hi")
    assert parse_detokenize({"model": None, "tokens": [72]}, TOKENIZER, "tiny") == [72]
    with pytest.raises(BadRequest) as e:  # past the model check: on to the (missing) template
        parse_chat({"model": None, "messages": [{"role": "user", "content": "Hi"}]}, TOKENIZER,
                   64, "tiny", None, Limits())
    assert e.value.code == "chat_template_missing"
    with pytest.raises(BadRequest, match='"other" does not exist') as e:
        parse_completion({"model": "other", "prompt": "Hi"}, TOKENIZER, 64, "tiny", Limits())
    assert e.value.param == "model" and e.value.code == "model_not_found"


# ---------------------------------------------------------------------------- stop strings

def test_stop_strings_past_what_a_context_holds_are_a_400_naming_stop():
    from plumbing.user_text import longest_token_bytes
    from serving.admission import Limits
    from serving.request_parsing import BadRequest, parse_completion
    context = 64
    bound = context * longest_token_bytes(TOKENIZER)
    at_bound = ["x" * (bound // 4)] * 4
    parsed = parse_completion({"prompt": "Hi", "stop": at_bound}, TOKENIZER, context, "tiny", Limits())
    assert parsed.samples[0].stop == tuple(at_bound)
    for stop in (["x" * (bound + 1)], [*at_bound[:3], "x" * (bound // 4 + 1)], ["x" * 250_000] * 4):
        with pytest.raises(BadRequest, match="'stop' strings have .* characters in all") as e:
            parse_completion({"prompt": "Hi", "stop": stop, "n": 64}, TOKENIZER, context, "tiny", Limits())
        assert e.value.param == "stop" and e.value.status == 400


def test_the_samples_of_a_request_share_one_matching_table_per_stop_string():
    from plumbing.text_stream import SampleText
    stops = ["ab" * 5_000, "cd" * 5_000]
    a, b = SampleText(TOKENIZER, stops), SampleText(TOKENIZER, stops)
    assert all(x.border is y.border for x, y in zip(a.stops, b.stops))
    for token in b"abab":
        a.add(token)
    assert a.ready() == 0 and b.ready() == 0  # the matches are each sample's own
