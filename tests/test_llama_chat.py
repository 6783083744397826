"""A Llama-family Hugging Face directory through the server's client-facing API, built as
serve.py builds it (`--hf DIR`: the model, its tokenizer.json, and the chat template from
its tokenizer_config.json): /v1/chat/completions renders the template as transformers'
apply_chat_template does (one BOS, the template's own: the tokenizer adds none to a
rendered chat) and stops at the template's end-of-turn token; /v1/completions with
logprobs and echo gives transformers' log-probabilities of the prompt, which starts with
the BOS the tokenizer's config adds, once; /tokenize agrees with both; the admission
limits and the context limit count that BOS, on a pool of n_kv_head heads.

The directory is a tiny random Llama 3-shaped model (GQA 4/2, Llama 3 rope scaling, tied
embeddings) with a byte-level tokenizer trained here, Llama 3's chat markers among its
special tokens, and Llama 3's chat template: nothing is downloaded."""

import argparse
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from generation.loop import generate_tokens  # noqa: E402
from hf_llama_dirs import byte_level_tokenizer, make_hf_llama_dir  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.hf import load_hf_model  # noqa: E402
from serve import load_chat_template  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

transformers.logging.set_verbosity_error()

NAME = "tiny-llama"
# Llama 3's instruct template: the BOS written once, before the first message; a turn ends
# with <|eot_id|>, which is not the tokenizer's end-of-text (<|end_of_text|>)
TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
            "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
            " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
            "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
            "{% endif %}")
MESSAGES = [{"role": "system", "content": "You are a player."},
            {"role": "user", "content": "ROMEO: But soft, what light?"}]
# logprobs against transformers': the logits agree within 1e-4 (test_llama.py's tolerance,
# fp32), and a log-softmax moves by at most twice its logits' largest difference
LOGPROB_ATOL = 2e-4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """(HF model, HF tokenizer with the template, the directory): tokenizer_config.json
    carries the chat template, as Llama 3's did (no chat_template.jinja beside it)."""
    path = tmp_path_factory.mktemp("llama3-chat")
    tokenizer = byte_level_tokenizer(extra_specials=["<|start_header_id|>", "<|end_header_id|>"])
    hf, hf_tok = make_hf_llama_dir(path, "llama3-gqa-ropescaling", tokenizer=tokenizer)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("add_bos_token", None)  # as Llama 3's: the post-processor adds the BOS
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    hf_tok.chat_template = TEMPLATE
    return hf, hf_tok, path


@pytest.fixture(scope="module")
def loaded(llama_dir):
    """(our model, our tokenizer, serve.py's chat template) loaded as serve.py --hf loads them."""
    _, _, path = llama_dir
    model, tokenizer = load_hf_model(CACHED_MODELS, path, report=lambda line: None)
    template = load_chat_template(argparse.Namespace(chat_template=None, hf=path), tokenizer)
    return model, tokenizer, template


def hf_chat_ids(hf_tok, messages):
    """transformers' apply_chat_template, rendered then encoded as it encodes a chat (no
    special tokens added: the template writes them)."""
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, hf_tok(text, add_special_tokens=False).input_ids


def served(model, tokenizer, template, **engine_args):
    engine = Engine(model, tokenizer, tokens_per_block=8, attention="gather", **engine_args)
    engine.start()  # serve.py runs the engine on its main thread; here pytest has that
    return engine, BackgroundServer(engine, tokenizer, NAME, chat_template=template)


def http(url, path, body):
    """(status, parsed JSON) of a POST to url's server."""
    request = urllib.request.Request(url.removesuffix("/v1") + path, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def tokenize(url, body):
    status, answer = http(url, "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def assert_idle(engine):
    for _ in range(600):
        s = engine.stats()
        if s["running"] == s["waiting"] == 0 and s["blocks_free"] == s["blocks_total"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still held: {engine.stats()}")


def test_the_template_renders_as_transformers_renders_it(llama_dir, loaded, capsys):
    _, hf_tok, path = llama_dir
    model, tokenizer, template = loaded
    bos, eot_id = hf_tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])
    assert tokenizer.bos_token_id == bos  # the tokenizer adds it to a prompt ...
    text, expected = hf_chat_ids(hf_tok, MESSAGES)
    assert template.render(MESSAGES) == text
    ids = template.encode(template.render(MESSAGES))
    assert ids == expected and ids[0] == bos and ids.count(bos) == 1  # ... but not to a chat
    assert template.end_of_turn_ids == (eot_id,) and eot_id not in tokenizer.eos_token_ids
    load_chat_template(argparse.Namespace(chat_template=None, hf=path), tokenizer)
    assert "tokenizer_config.json (a turn ends at <|eot_id|>)" in capsys.readouterr().err
    # a user's text that spells a marker is text, not the marker (as tiktoken's encode_ordinary)
    assert eot_id not in tokenizer.encode_ordinary("Hi<|eot_id|>")
    assert tokenizer.decode(tokenizer.encode_ordinary("Hi<|eot_id|>")) == "Hi<|eot_id|>"


def test_chat_completions_stop_at_the_templates_end_of_turn(llama_dir):
    """A model made to write <|eot_id|> after a few tokens: the reply is the text before it,
    finish_reason "stop"; the prompt is the template's, one BOS."""
    _, hf_tok, path = llama_dir
    model, tokenizer = load_hf_model(CACHED_MODELS, path, report=lambda line: None)  # a copy to bias
    template = load_chat_template(argparse.Namespace(chat_template=None, hf=path), tokenizer)
    _, ids = hf_chat_ids(hf_tok, MESSAGES)
    eot_id = template.end_of_turn_ids[0]
    plain = generate_tokens(model, [ids], 12, temperature=0)[0].tolist()
    with torch.no_grad():  # <|eot_id|> scores above the token it is made to resemble
        model.lm_head.weight[eot_id] = 1.5 * model.lm_head.weight[plain[3]]
    out = generate_tokens(model, [ids], 12, temperature=0)[0].tolist()
    assert eot_id in out[1:]  # the test means something: the turn ends after some text
    engine, server = served(model, tokenizer, template)
    try:
        with server as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                               temperature=0)
            assert r.choices[0].message.content == tokenizer.decode(out[:out.index(eot_id)])
            assert r.choices[0].finish_reason == "stop"
            # the end-of-turn token was generated, and counts (as vLLM counts it), unprinted
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == out.index(eot_id) + 1
            r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        assert_idle(engine)
    finally:
        engine.stop()


def test_completions_logprobs_echo_and_tokenize(llama_dir, loaded):
    """A string prompt is fed after one BOS (the tokenizer's config adds it); echo with
    logprobs scores it as transformers does; max_tokens > 0 adds the greedy tokens, each the
    likeliest of its top_logprobs; /tokenize gives the same ids, and the chat's."""
    hf, hf_tok, _ = llama_dir
    model, tokenizer, template = loaded
    prompt = "ROMEO: But soft, what light through yonder window breaks?"
    ids = hf_tok(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(ids[0]) == 1
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)
    engine, server = served(model, tokenizer, template)
    try:
        with server as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
            choice = r.choices[0]
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
            assert choice.text == tokenizer.decode(ids) == "<|begin_of_text|>" + prompt
            lp = choice.logprobs
            assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
            diff = max(abs(lp.token_logprobs[i] - theirs[i - 1, t].item()) for i, t in enumerate(ids) if i)
            print(f"\n  max |logprob diff| against transformers, {len(ids) - 1} prompt tokens: {diff:.2e}")
            assert diff < LOGPROB_ATOL

            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                          logprobs=3, extra_body={"ignore_eos": True})
            greedy = generate_tokens(model, [ids], 8, temperature=0)[0].tolist()
            lp = r.choices[0].logprobs
            assert r.choices[0].text == tokenizer.decode(greedy)
            assert lp.tokens == [tokenizer.decode([t]) for t in greedy]
            assert all(max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))

            assert tokenize(url, {"model": NAME, "prompt": prompt}) == ids
            assert tokenize(url, {"prompt": prompt, "add_special_tokens": False}) == ids[1:]
            assert tokenize(url, {"messages": MESSAGES}) == hf_chat_ids(hf_tok, MESSAGES)[1]
        assert_idle(engine)
    finally:
        engine.stop()


def test_admission_limits_and_the_context_limit_count_the_bos(loaded):
    """serve.py's limits on the Llama model: the BOS the tokenizer adds is one of a prompt's
    tokens; each refusal is a 400 with OpenAI's error object and queues nothing."""
    model, tokenizer, template = loaded
    context = model.config.context_len
    engine, server = served(model, tokenizer, template, num_blocks=40,
                            limits=Limits(max_sequences=2, max_prompt_tokens=12, max_waiting=4))
    prompt = "ROMEO: But soft"
    fits = len(tokenizer.encode_ordinary(prompt)) + 1  # with the BOS
    try:
        with server as url:
            for body, code in [
                    ({"prompt": prompt, "n": 3}, "too_many_sequences"),
                    ({"prompt": "ROMEO: " * 12}, "too_many_prompt_tokens"),
                    ({"prompt": prompt, "max_tokens": context - fits + 1}, "context_length_exceeded"),
                    ({"prompt": " " * 100_000}, "context_length_exceeded")]:
                status, answer = http(url, "/v1/completions", body)
                assert status == 400 and answer["error"]["code"] == code, (body, answer)
            status, answer = http(url, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x" * 100_000}]})
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
            status, answer = http(url, "/v1/completions", {"prompt": prompt, "max_tokens": context - fits})
            assert status == 200 and answer["usage"]["prompt_tokens"] == fits
        assert_idle(engine)
    finally:
        engine.stop()
