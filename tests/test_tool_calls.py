"""Tool calls and structured outputs through the HTTP side (serving/tool_calls.py,
replies.py), checked with the official openai package:

  - the calls read out of a reply's text in both families' shapes (Hermes/Qwen's
    <tool_call> blocks, Llama 3's bare JSON), content streamed as soon as it cannot be the
    start of a call;
  - against a scripted engine (it writes a given text; no model), the package's own
    parsing: message.tool_calls, a stream's tool_calls deltas gathered by its stream
    helper, message.parsed from chat.completions.parse with a pydantic model, and the
    constraint the engine was handed;
  - against the real engine on a tiny random model: tool_choice "required" and
    response_format from a pydantic model give what the package parses (the engine's
    grammar constraint does the work)."""

import json
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from base_model import GPTConfig  # noqa: E402
from conftest import byte_tokenizer_spec, tiny_model  # noqa: E402
from plumbing.tokenizer import encoding_from_spec  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.chat import ChatTemplate  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.paged_cache import BlockPool  # noqa: E402
from serving.requests import Output  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402
from serving.tool_calls import ToolUse  # noqa: E402

TOKENIZER = encoding_from_spec({**byte_tokenizer_spec(), "special_tokens": {
    "<|endoftext|>": 256, "<|end|>": 257}}, "test")
CONTEXT = 512
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NAME = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


# ---------------------------------------------------------------------------- reading the text

def calls(text, choice="auto", parallel=True):
    content, found = ToolUse([WEATHER, CLOCK], choice, parallel).calls_in(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


def test_calls_are_read_in_hermes_and_llama_shapes():
    paris = ("get_weather", {"city": "Paris"})
    assert calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == ("", [paris])
    assert calls('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                 '<tool_call>{"name": "get_time", "arguments": {}}') == ("Let me look.", [paris, ("get_time", {})])
    assert calls(' {"name": "get_weather", "parameters": {"city": "Paris"}}') == ("", [paris])
    assert calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_time", "parameters": {}}') == ("", [paris, ("get_time", {})])
    assert calls('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "required") == ("", [paris])
    assert calls('{"city": "Paris"}', "get_weather") == ("", [paris])
    assert calls('{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
                 parallel=False)[1] == [("get_time", {})]


@pytest.mark.parametrize("text", [
    "It is sunny.", '{"name": "rm_rf", "parameters": {}}', '{"name": "get_weather"}',
    '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', '{"city": "Par',
    '<tool_call>not json</tool_call>'])
def test_text_that_is_not_a_call_of_an_offered_tool_is_content(text):
    assert calls(text) == (text, [])


def streamed(pieces):
    reader = ToolUse([WEATHER], "auto").reader()
    out = [reader.add(p) for p in pieces]
    return out, reader.end()


def test_content_streams_until_it_may_be_a_call_and_the_call_comes_at_the_end():
    out, (rest, found) = streamed(["Sun", "ny <tool", "_call>", '{"name": "get_weather", ',
                                   '"arguments": {"city": "Rome"}}</tool_call>'])
    assert out == ["Sun", "ny ", "", "", ""] and rest == "" and len(found) == 1
    out, (rest, found) = streamed(["Sunny <tool", "s are nice"])
    assert out == ["Sunny ", "<tools are nice"] and (rest, found) == ("", [])
    out, (rest, found) = streamed([" {", '"a": 1}'])  # may be Llama's call: held to the end
    assert out == ["", ""] and (rest, found) == (' {"a": 1}', [])


# ---------------------------------------------------------------------------- a scripted engine

class ScriptedRequest:
    """What the server reads of an engine's request (a class: the server keeps weak
    references to them, for /v1/cache)."""

    def __init__(self):
        self.num_generated, self.cached_prompt_tokens, self.token_times = 0, 0, []


class ScriptedEngine:
    """What the server needs of an engine, writing `text` three characters at a time to
    every request: the HTTP side without a model. samples: the SamplingParams of the last
    request, as the server handed them over."""

    def __init__(self):
        self.text, self.samples, self.limits = "", None, Limits()
        config = SimpleNamespace(context_len=CONTEXT, n_layer=1, n_kv_head=1, head_dim=2)
        self.model = SimpleNamespace(config=config, lm_head=SimpleNamespace(weight=torch.zeros(2, 2)))
        self.pool = BlockPool(config, num_blocks=CONTEXT // 16)  # for /v1/cache's formula
        self.after_hand_out = []  # the server's HandOut.flush: called once the outputs are out

    def submit(self, prompts, samples, on_output, processors=None):
        self.samples = samples
        requests = [ScriptedRequest() for _ in prompts for _ in samples]
        threading.Thread(target=self.write, args=(requests, on_output)).start()
        return requests

    def write(self, requests, on_output):
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)]
        for r in requests:
            for k, piece in enumerate(pieces):
                r.num_generated += 1
                on_output(r, Output(piece, finish_reason="stop" if k == len(pieces) - 1 else None))
        for hook in self.after_hand_out:
            hook()

    def cancel(self, request):
        pass

    def stats(self):
        return {"running": 0, "waiting": 0}


@pytest.fixture(scope="module")
def scripted():
    engine = ScriptedEngine()
    with BackgroundServer(engine, TOKENIZER, NAME, chat_template=ChatTemplate(TEMPLATE, TOKENIZER)) as url:
        yield engine, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


HERMES_CALL = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_a_tool_call_in_the_reply_is_message_tool_calls(scripted):
    engine, client = scripted
    engine.text = HERMES_CALL
    r = client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, CLOCK], n=2)
    for choice in r.choices:
        call, = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look. "
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    assert engine.samples[0].structured is None  # "auto": not held to a schema
    engine.text = HERMES_CALL
    r = client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == HERMES_CALL and r.choices[0].message.tool_calls is None


def test_a_streamed_tool_call_is_gathered_by_the_packages_stream_helper(scripted):
    engine, client = scripted
    engine.text = HERMES_CALL
    chunks = list(client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content == "Let me look. " and [d.index for d in deltas] == [0]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model=NAME, messages=USER, tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    call, = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_required_and_named_tools_hand_the_engine_their_schema(scripted):
    engine, client = scripted
    engine.text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    r = client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False)
    kind, schema = engine.samples[0].structured
    assert kind == "json" and schema["maxItems"] == 1
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    engine.text = '{"city": "Rome"}'
    r = client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.samples[0].structured == ("json", WEATHER["function"]["parameters"])
    call, = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})


def test_parse_with_a_pydantic_model_returns_message_parsed(scripted):
    engine, client = scripted
    engine.text = '{"city": "Rome", "sunny": true}'
    r = client.chat.completions.parse(model=NAME, messages=USER, response_format=Weather)
    assert r.choices[0].message.parsed == Weather(city="Rome", sunny=True)
    kind, schema = engine.samples[0].structured
    assert kind == "json" and schema["properties"]["city"]["enum"] == ["Paris", "Rome"]


def test_a_refused_field_is_the_packages_bad_request_error(scripted):
    _, client = scripted
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice" and "not one of the tools (get_weather)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=USER, extra_body={"guided_jsn": {}})
    assert (e.value.param, e.value.code) == ("guided_jsn", "unknown_parameter")


HOSTILE_BODIES = [  # (body, param): each a one-line 400, before the engine sees anything
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"x": {"description": "y" * 200_000}}}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x" * 10_000}}},
     "tool_choice"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                         "function": {"name": "f", "arguments": 5}}]}]},
     "messages"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {str(i): {"type": "string"} for i in range(20_000)}}}}},
     "response_format"),
]


@pytest.mark.parametrize("fields,param", HOSTILE_BODIES)
def test_hostile_bodies_are_one_line_400s(scripted, fields, param):
    engine, client = scripted
    engine.samples = None
    body = json.dumps({"model": NAME, "messages": USER, **fields}).encode()
    request = urllib.request.Request(str(client.base_url) + "chat/completions", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and len(error["message"]) < 1500
    assert engine.samples is None  # nothing was submitted


# ---------------------------------------------------------------------------- the real engine

@pytest.fixture(scope="module")
def real():
    """The openai client on a tiny random model: what it writes is the constraint's doing."""
    config = GPTConfig(context_len=CONTEXT, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
    engine = Engine(tiny_model(config, seed=5), TOKENIZER, tokens_per_block=8)
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, NAME, chat_template=ChatTemplate(TEMPLATE, TOKENIZER)) as url:
            yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.stop()


def test_tool_choice_required_on_a_random_model_is_a_call_the_package_parses(real):
    for seed in range(3):
        r = real.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], tool_choice="required",
                                         max_tokens=200, temperature=1.0, seed=seed)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_parse_on_a_random_model_returns_a_valid_instance(real):
    for seed in range(3):
        r = real.chat.completions.parse(model=NAME, messages=USER, response_format=Weather,
                                        max_tokens=200, temperature=1.0, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Weather)
