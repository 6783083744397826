"""What clients other than a plain completion call need from the server (serving/server.py,
replies.py, chat.py, metrics.py), through the official openai client and raw HTTP:
logprobs and echo (equal to a direct forward of the model), chat completions with a chat
template made here, /tokenize and /detokenize, an API key, /metrics, the context limit,
usage details; a 4xx with OpenAI's error object for every bad new field; and every block
back in the pool afterwards.

The chat model here is the GPT family's tiny model with a template written for the test:
nothing in the chat path knows the model family (the Llama family's own test, with its
tokenizer.json and Llama 3's template, is test_llama_chat.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from base_model import GPTConfig  # noqa: E402
from conftest import NO_BACKGROUND_BUILD, ROOT, byte_tokenizer_spec, run_script, tiny_model  # noqa: E402
from generation.loop import generate_tokens  # noqa: E402
from plumbing.tokenizer import encoding_from_spec  # noqa: E402
from serving.chat import ChatTemplate, template_from_hf_dir  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
# bytes, <|endoftext|> (256) and an end-of-turn token of the template's own (257)
TOKENIZER = encoding_from_spec({**byte_tokenizer_spec(), "special_tokens": {
    "<|endoftext|>": 256, "<|end|>": 257}}, "test")
END = 257
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NAME = "tiny"
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=5)


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, TOKENIZER, tokens_per_block=8)
    engine.start()  # serve.py runs the engine on its main thread; here pytest has that
    yield engine
    engine.stop()


def serve(engine, **server_args):
    return BackgroundServer(engine, TOKENIZER, NAME, **server_args)


@pytest.fixture(scope="module")
def url(engine):
    with serve(engine, chat_template=ChatTemplate(TEMPLATE, TOKENIZER)) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def http(url, path, body=None, key=None):
    """(status, parsed JSON or text) of a GET (body None) or POST to url's server."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url.removesuffix("/v1") + path, data=data)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def assert_idle(engine):
    """Every request finished, every block back in the pool."""
    for _ in range(600):
        s = engine.stats()
        if s["running"] == s["waiting"] == 0 and s["blocks_free"] == s["blocks_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {engine.stats()}")


def direct_logprobs(model, tokens):
    """log_softmax of one plain forward: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0][0, :-1, :TOKENIZER.n_vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def greedy(model, ids, n):
    """The n tokens greedy generation writes after ids, alone."""
    return generate_tokens(model, [ids], n, temperature=0, vocab_limit=TOKENIZER.n_vocab)[0].tolist()


# ---------------------------------------------------------------------------- logprobs and echo

def test_echo_scores_a_prompt_as_a_direct_forward(client, url, model, engine):
    """lm-evaluation-harness's request: token ids, echo, max_tokens 0 or 1, logprobs."""
    ids = TOKENIZER.encode_ordinary("To be, or not to be, that is the question")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == TOKENIZER.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [TOKENIZER.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    direct = direct_logprobs(model, ids)
    for i, t in enumerate(ids[1:]):
        # within 1e-5: the same arithmetic as the direct forward, in other matmul shapes
        assert abs(lp.token_logprobs[i + 1] - direct[i, t].item()) < 1e-5
        top = lp.top_logprobs[i + 1]
        likeliest = direct[i].topk(3).indices.tolist()
        assert set(top) == {TOKENIZER.decode([x]) for x in likeliest + [t]}  # and the token's own
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)

    # lm-eval's exact body: one more token, whose logprob follows the prompt's
    status, body = http(url, "/v1/completions", {
        "model": NAME, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
        "temperature": 0, "seed": 1234})
    assert status == 200
    scored = body["choices"][0]["logprobs"]
    assert len(scored["token_logprobs"]) == len(ids) + 1
    assert scored["token_logprobs"][1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert_idle(engine)


def test_generated_tokens_logprobs_whole_and_streamed(client, model, engine):
    ids = TOKENIZER.encode_ordinary("Once upon")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    out = ids + greedy(model, ids, 8)
    direct = direct_logprobs(model, out)
    assert len(lp.token_logprobs) == 8 and lp.tokens == [TOKENIZER.decode([t]) for t in out[len(ids):]]
    for i, t in enumerate(out[len(ids):]):
        assert abs(lp.token_logprobs[i] - direct[len(ids) - 1 + i, t].item()) < 1e-5
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 2 and max(top, key=top.get) == lp.tokens[i]  # greedy: the likeliest
    assert lp.text_offset[0] == 0  # offsets count the choice's text (vLLM's convention)

    # streamed, with echo: the pieces add up to the whole answer, logprobs included
    whole = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                      logprobs=2, echo=True, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                            logprobs=2, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    for field in ("tokens", "token_logprobs", "text_offset"):
        streamed = [x for c in chunks for x in getattr(c.choices[0].logprobs, field)]
        assert streamed == getattr(whole.choices[0].logprobs, field)
    assert whole.choices[0].text.startswith(TOKENIZER.decode(ids))
    assert_idle(engine)


def test_usage_counts_prefix_cache_hits_and_the_stream_marks_usage_null(client, engine):
    prompt = "A long shared beginning of a prompt, forty characters or so"  # 7 full blocks of 8
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    assert first.system_fingerprint.startswith("fp_") and again.system_fingerprint == first.system_fingerprint
    assert again.usage.prompt_tokens_details.cached_tokens == 56
    chunks = list(client.completions.create(model=NAME, prompt="x", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens <= 3
    assert chunks[-1].choices == []
    # vLLM's continuous_usage_stats (guidellm sends it): the usage so far on every chunk
    chunks = list(client.completions.create(model=NAME, prompt="x", max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={
                                                "include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3 and chunks[-1].choices == []
    assert_idle(engine)


# ---------------------------------------------------------------------------- chat

def chat_ids(messages):
    return TOKENIZER.encode(ChatTemplate(TEMPLATE, TOKENIZER).render(messages), allowed_special="all")


def test_chat_plain_streamed_n_and_stop(client, model, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    ids = chat_ids(messages)
    assert ids[-len("<assistant>"):] == TOKENIZER.encode_ordinary("<assistant>")
    assert ids.count(END) == 2  # the markers are the special token, not its characters
    expected = TOKENIZER.decode(greedy(model, ids, 10))
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10

    def logprobs(**kw):  # each token's logprob, whole or gathered from a stream's chunks
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=1, **kw)
        chunks = list(r) if kw.get("stream") else [r]
        return [(c.token, c.logprob) for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    whole = logprobs()
    assert len(whole) == 10 and logprobs(stream=True) == whole

    texts = [c.message.content for c in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, n=3, seed=7, temperature=1.0,
        response_format={"type": "text"}).choices]  # plain text: the one format there is
    assert len(set(texts)) == 3

    stop = expected[3:5]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                       stop=[stop], logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == expected[:expected.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].logprobs.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert bytes(content[0].bytes).decode("utf-8", "replace") == content[0].token
    assert_idle(engine)


def test_chat_stops_at_the_templates_end_of_turn_token(model):
    """A model made to write the template's end-of-turn token after a few tokens: the reply
    is what comes before it, finish_reason "stop"; ignore_eos runs past it."""
    biased = tiny_model(CONFIG, seed=5)
    messages = [{"role": "user", "content": "Hi"}]
    ids = chat_ids(messages)
    plain = greedy(biased, ids, 12)
    with torch.no_grad():  # token 257 scores above whatever it is made to follow
        biased.lm_head.weight[END] = 1.5 * biased.lm_head.weight[plain[3]]
    out = greedy(biased, ids, 12)
    assert END in out[1:]  # the test means something: the turn ends after some text
    engine = Engine(biased, TOKENIZER, tokens_per_block=8)
    engine.start()
    try:
        with serve(engine, chat_template=ChatTemplate(TEMPLATE, TOKENIZER)) as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                               temperature=0)
            assert r.choices[0].message.content == TOKENIZER.decode(out[:out.index(END)])
            assert r.choices[0].finish_reason == "stop"
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        assert_idle(engine)
    finally:
        engine.stop()


def test_the_templates_end_of_turn_is_found_by_rendering_it(tmp_path):
    assert ChatTemplate(TEMPLATE, TOKENIZER).end_of_turn_ids == (END,)
    eot_only = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    assert ChatTemplate(eot_only, TOKENIZER).end_of_turn_ids == (256,)
    no_marker = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert ChatTemplate(no_marker, TOKENIZER).end_of_turn_ids == ()
    # a Hugging Face directory's tokenizer_config.json, its bos/eos strings with it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "bos_token": {"content": "<|end|>"}}))
    template = template_from_hf_dir(tmp_path, TOKENIZER)
    assert template.encode(template.render([{"role": "user", "content": "a"}])) == [END, 97]
    (tmp_path / "none").mkdir()
    assert template_from_hf_dir(tmp_path / "none", TOKENIZER) is None


def test_a_model_without_a_template_refuses_chat_saying_how_to_give_one(engine):
    with serve(engine) as url:
        status, body = http(url, "/v1/chat/completions",
                            {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 400 and "--chat-template FILE" in body["error"]["message"]
        assert body["error"]["param"] == "messages"


# ---------------------------------------------------------------------------- tokenize, key, metrics

def test_tokenize_and_detokenize_in_vllms_shape(url):
    status, body = http(url, "/tokenize", {"model": NAME, "prompt": "Héllo"})
    assert status == 200 and body == {"count": 6, "max_model_len": 64, "tokens": list("Héllo".encode()),
                                      "token_strs": None}
    messages = [{"role": "user", "content": "Hi"}]
    assert http(url, "/tokenize", {"messages": messages})[1]["tokens"] == chat_ids(messages)
    assert http(url, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "Héllo"})


def test_an_api_key_is_required_except_for_health(engine):
    with serve(engine, api_key=KEY, chat_template=ChatTemplate(TEMPLATE, TOKENIZER)) as url:
        wrong = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}])
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert KEY not in str(e.value.body)
        for path, body in [("/v1/completions", {"prompt": "a"}), ("/v1/models", None),
                           ("/tokenize", {"prompt": "a"}), ("/metrics", None)]:
            status, reply = http(url, path, body)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", path
        assert http(url, "/health")[0] == 200
        right = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        assert right.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}],
                                             max_tokens=2).choices
        assert http(url, "/metrics", key=KEY)[0] == 200


def metrics(url):
    status, text = http(url, "/metrics")
    assert status == 200
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.labels or s.labels.get("finish_reason") == "length"}


def test_metrics_count_requests_tokens_and_latencies(engine):
    with serve(engine) as url:  # a registry of its own: starts at zero beside the other servers
        before = metrics(url)
        assert before["kvcache_generation_tokens_total"] == 0
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model=NAME, prompt=["ab", "cde"], max_tokens=5,
                                  extra_body={"ignore_eos": True})
        m = metrics(url)
        assert m["kvcache_generation_tokens_total"] == 10 and m["kvcache_prompt_tokens_total"] == 5
        assert m["kvcache_requests_total"] == 2
        assert m["kvcache_time_to_first_token_seconds_count"] == 2
        assert m["kvcache_inter_token_latency_seconds_count"] == 8
        assert m["kvcache_kv_blocks_used"] + m["kvcache_kv_blocks_free"] == m["kvcache_kv_blocks_total"]
        assert m["kvcache_num_requests_running"] == m["kvcache_num_requests_waiting"] == 0
        assert 0 <= m["kvcache_prefix_cache_hit_rate"] <= 1 and "kvcache_num_preemptions_total" in m


# ---------------------------------------------------------------------------- the context limit

def test_prompt_plus_max_tokens_past_the_context_is_a_400_naming_both(url, engine):
    ids = list(range(60))
    status, body = http(url, "/v1/completions", {"prompt": ids, "max_tokens": 20})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in body["error"]["message"]
    assert "80 tokens (60 in the prompt, 20 in the completion)" in body["error"]["message"]
    status, body = http(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}],
                                                      "max_tokens": 30})
    assert status == 400 and "in the messages, 30 in the completion" in body["error"]["message"]
    # without max_tokens, a chat reply gets the room that is left (as vLLM)
    status, body = http(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}],
                                                      "ignore_eos": True})
    assert status == 200 and body["usage"]["total_tokens"] == 64
    with serve(engine, context_policy="reprefill") as keep_going:
        status, body = http(keep_going, "/v1/completions", {"prompt": ids, "max_tokens": 20,
                                                            "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 20
    assert_idle(engine)


# ---------------------------------------------------------------------------- bad requests

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": "2"}, "logprobs", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1, "2"]}, "stop_token_ids", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [999]}, "stop_token_ids", "invalid_value"),
    ("/v1/chat/completions", {"model": NAME}, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, "model", "model_not_found"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools",
     "missing_required_parameter"),  # its function
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "stream_options": "x"}, "stream_options", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "add_generation_prompt": "no"}, "add_generation_prompt",
     "invalid_type"),
    ("/v1/chat/completions", b"{not json", None, None),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "add_special_tokens", "invalid_type"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages", "invalid_type"),
    ("/tokenize", [1], None, None),
    ("/detokenize", {"tokens": "abc"}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [True]}, "tokens", "invalid_type"),
]


@pytest.mark.parametrize("path,body,param,code", BAD_REQUESTS)
def test_bad_new_fields_get_400_and_an_openai_error(url, path, body, param, code):
    status, reply = http(url, path, body)
    assert status == 400
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_a_template_that_refuses_the_messages_is_a_400(engine):
    refusing = "{{ raise_exception('Conversation roles must alternate') }}"
    with serve(engine, chat_template=ChatTemplate(refusing, TOKENIZER)) as url:
        status, body = http(url, "/v1/chat/completions", CHAT)
        assert status == 400 and "roles must alternate" in body["error"]["message"]


def test_no_block_is_left_out_of_the_pool(engine):
    """Last: after everything above (streams, echo, chat, refusals), the pool is whole."""
    assert_idle(engine)
    assert not any(engine.pool.ref_count)


# ---------------------------------------------------------------------------- serve.py's flags

def test_serve_py_takes_the_key_from_the_environment_and_never_prints_it(tiny_ckpt, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE.replace("<|end|>", "<|endoftext|>"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVCACHE_API_KEY": KEY, **NO_BACKGROUND_BUILD}
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--ckpt", str(tiny_ckpt),
                                "--port", "0", "--device", "cpu", "--attention", "gather",
                                "--chat-template", str(template)],
                               cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.startswith("serving "):
                url = line.split()[3]
                break
        else:
            raise AssertionError("serve.py ended without serving: " + "".join(lines))
        assert "API key required" in lines[-1] and "a turn ends at <|endoftext|>" in "".join(lines)
        assert http(url, "/v1/models")[0] == 401
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        r = client.chat.completions.create(model="kvcache-gpt", max_tokens=3,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.role == "assistant"
        # the rest of stderr read on a thread: a server blocked on a full pipe cannot exit
        rest = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
        rest.start()
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=60) == 130
        except subprocess.TimeoutExpired:
            raise AssertionError("serve.py did not stop on Ctrl-C; its stderr ended: "
                                 + "".join(lines)[-3000:]) from None
        rest.join(timeout=10)
        assert KEY not in "".join(lines)
    finally:
        process.kill()


@pytest.mark.parametrize("args,message", [
    (["--api-key", ""], "--api-key (or $KVCACHE_API_KEY) is empty"),
    (["--chat-template", "no/such/file.jinja"], "--chat-template: no/such/file.jinja: cannot read it"),
    (["--context-policy", "sinks"], "--context-policy: one of error, reprefill, got 'sinks': sinks is generate.py's"),
    (["--context-policy", "nope"], "--context-policy: one of error, reprefill, got 'nope'"),
])
def test_serve_py_bad_new_flags_exit_2_with_one_line(tiny_ckpt, args, message, tmp_path):
    result = run_script("serve.py", "--ckpt", tiny_ckpt, "--device", "cpu", "--port", "0", *args)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_template_that_is_not_jinja_is_one_line(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    result = run_script("serve.py", "--ckpt", tiny_ckpt, "--device", "cpu", "--chat-template", bad)
    assert result.returncode == 2 and "not a Jinja template" in result.stderr
