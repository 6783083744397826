"""Every request field honoured or refused (serving/request_schema.py, request_parsing.py):
each field the schema names reaches SamplingParams (OpenAI's names and vLLM's), each
structured-output spelling becomes the one constraint, everything else is a 400 naming
the field, bounded, one line; and docs/clients.md's table lists exactly the schema's
fields. No model: these read requests only."""

import json
import re

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("jinja2")

from conftest import ROOT, byte_tokenizer_spec  # noqa: E402
from plumbing.tokenizer import encoding_from_spec  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.chat import ChatTemplate  # noqa: E402
from serving.request_parsing import BadRequest, parse_chat, parse_completion  # noqa: E402
from serving.request_schema import (MAX_SPEC_CHARS, MAX_TOOLS, ChatRequest,  # noqa: E402
                                    CompletionRequest, fields_of)

TOKENIZER = encoding_from_spec({**byte_tokenizer_spec(), "special_tokens": {
    "<|endoftext|>": 256, "<|end|>": 257}}, "test")
CONTEXT = 1024  # bytes: room for a tool list in the prompt
# renders what transformers' templates read: tools, tool calls, tool answers, extra variables
TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}<|end|>{% endif %}"
            "{% if enable_thinking is defined %}<think={{ enable_thinking }}>{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
            "{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
            "<call>{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def completion(**fields):
    return parse_completion({"prompt": "Hi", **fields}, TOKENIZER, CONTEXT, "tiny", Limits())


def chat(messages=USER, **fields):
    return parse_chat({"messages": messages, **fields}, TOKENIZER, CONTEXT, "tiny",
                      ChatTemplate(TEMPLATE, TOKENIZER), Limits())


def refused(parse, **fields):
    """The BadRequest a request gets; its message is one line and bounded."""
    with pytest.raises(BadRequest) as e:
        parse(**fields)
    message = str(e.value)
    assert "\n" not in message and len(message) < 1500 and e.value.status == 400
    return e.value


# ---------------------------------------------------------------------------- honoured

def test_every_sampling_field_reaches_sampling_params():
    params = completion(max_tokens=20, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                        logit_bias={"65": 5, "10": -100}, min_tokens=4, bad_words=["foo", "bar"],
                        allowed_token_ids=[65, 66, 67], include_stop_str_in_output=True,
                        stop=["\n"], stop_token_ids=[3], ignore_eos=True).samples[0]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (20, 0.5, 0.9, 5)
    assert (params.min_p, params.seed, params.presence_penalty, params.frequency_penalty) == (0.1, 3, 0.5, -0.5)
    assert params.repetition_penalty == 1.3 and params.logit_bias == ((10, -100), (65, 5))
    assert params.min_tokens == 4 and params.bad_words == ("foo", "bar")
    assert params.allowed_token_ids == (65, 66, 67) and params.include_stop_str_in_output
    assert params.stop == ("\n",) and params.stop_token_ids == (3,) and not params.stop_at_eot
    assert params.structured is None


def test_the_defaults_are_the_samplers_identity():
    params = completion().samples[0]
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (params.min_p, params.logit_bias, params.min_tokens, params.bad_words) == (0.0, (), 0, ())
    assert params.allowed_token_ids is None and not params.include_stop_str_in_output
    assert params.top_k is None and params.top_p is None and params.temperature == 1.0


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_and_minus_one_are_off_as_in_vllm_and_llama_cpp(top_k):
    assert completion(top_k=top_k).samples[0].top_k is None


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS = [  # (request fields, SamplingParams.structured)
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", None)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                 "strict": True}}}, ("json", SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, ("json", SCHEMA)),
    ({"structured_outputs": {"regex": "[ab]+"}}, ("regex", "[ab]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
    ({"guided_json": SCHEMA}, ("json", SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, ("json", SCHEMA)),  # vLLM takes a string too
    ({"guided_regex": "[ab]+"}, ("regex", "[ab]+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
]


@pytest.mark.parametrize("fields,structured", CONSTRAINTS)
def test_each_spelling_of_a_constraint_is_the_one_structured_setting(fields, structured):
    assert completion(**fields).samples[0].structured == structured
    assert chat(**fields).samples[0].structured == structured


def test_two_constraints_are_a_400_naming_the_second():
    error = refused(completion, response_format={"type": "json_object"}, guided_regex="a+")
    assert error.param == "guided_regex" and "both constrain the output" in str(error)
    error = refused(completion, structured_outputs={"regex": "a", "choice": ["a"]})
    assert error.param == "structured_outputs" and "exactly one of" in str(error)
    error = refused(chat, tools=[WEATHER], tool_choice="required", guided_json=SCHEMA)
    assert (error.param, error.code) == ("tool_choice", "invalid_value")


# ---------------------------------------------------------------------------- chat's own fields

def rendered(parsed):
    return TOKENIZER.decode(parsed.prompts[0])


def test_tools_tool_calls_tool_answers_and_kwargs_reach_the_template():
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = rendered(chat(messages, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}))
    assert text.startswith("<tools>[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"")
    assert "<think=False>" in text
    # arguments reach the template as the object they spell (its tojson writes them back)
    assert '<assistant><call>get_weather{"city": "Paris"}<|end|>' in text
    assert text.endswith("<tool>[call_1]sunny<|end|><assistant>")
    assert "<tools>" not in rendered(chat())  # no tools: tools is none


def test_continue_final_message_cuts_the_turn_after_the_last_words():
    messages = [*USER, {"role": "assistant", "content": "Once upon a "}]
    assert rendered(chat(messages, continue_final_message=True)).endswith("<assistant>Once upon a ")
    assert rendered(chat(messages, add_generation_prompt=False)).endswith("Once upon a <|end|>")
    assert refused(chat, messages=messages, continue_final_message=True,
                   add_generation_prompt=True).param == "continue_final_message"
    assert refused(chat, continue_final_message=True).param == "continue_final_message"


def test_a_required_or_named_tool_is_held_to_its_json_schema():
    structured = chat(tools=[WEATHER, CLOCK], tool_choice="required").samples[0].structured
    kind, schema = structured
    assert kind == "json" and schema["type"] == "array" and schema["minItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and "maxItems" not in schema
    one = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert one.samples[0].structured[1]["maxItems"] == 1
    named = chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.samples[0].structured == ("json", WEATHER["function"]["parameters"])
    for choice in ("auto", "none"):
        assert chat(tools=[WEATHER], tool_choice=choice).samples[0].structured is None
    assert chat(tools=[WEATHER]).tools.choice == "auto"  # as OpenAI: auto when tools are given


# ---------------------------------------------------------------------------- refused

UNSUPPORTED = [  # (endpoint, field, a value that asks for what is not implemented)
    (completion, "best_of", 2), (completion, "suffix", "x"), (chat, "functions", [{}]),
    (chat, "function_call", "auto"), (chat, "audio", {"voice": "x"}), (chat, "modalities", ["audio"]),
    (chat, "prediction", {"type": "content"}), (chat, "reasoning_effort", "high"),
    (chat, "web_search_options", {}), (chat, "store", True), (chat, "metadata", {"a": "b"}),
]


@pytest.mark.parametrize("parse,field,value", UNSUPPORTED)
def test_a_field_we_do_not_implement_is_a_400_naming_it(parse, field, value):
    error = refused(parse, **{field: value})
    assert (error.param, error.code) == (field, "unsupported_parameter") and field in str(error)


@pytest.mark.parametrize("parse,model", [(completion, CompletionRequest), (chat, ChatRequest)])
def test_an_unknown_field_is_a_400_listing_what_is_supported(parse, model):
    error = refused(parse, temprature=0.5)
    assert (error.param, error.code) == ("temprature", "unknown_parameter")
    assert all(name in str(error) for name in fields_of(model))
    error = refused(parse, response_format={"type": "json_schema", "json_schema": {"name": "a", "shcema": {}}})
    assert error.param == "response_format" and "response_format.json_schema.shcema" in str(error)


HOSTILE = [  # (fields of a chat request, the param its 400 names)
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [{**CLOCK, "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),  # one name twice
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "description": "x" * MAX_SPEC_CHARS}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "description": "x" * (MAX_SPEC_CHARS // 4)}}} for i in range(5)], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing to choose from
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "nickname": "bob"}]}, "messages"),
    ({"chat_template_kwargs": {"enable_thinking": "x" * 20_000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"properties": {"x": {"enum": list(range(30_000))}}}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": "x" * (MAX_SPEC_CHARS + 1)}, "guided_grammar"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999": 1}}, "logit_bias"),  # not a token of the vocabulary
    ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["x"] * 1000}, "bad_words"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options"),
]


@pytest.mark.parametrize("fields,param", HOSTILE)
def test_hostile_requests_are_one_bounded_line_naming_the_field(fields, param):
    assert refused(chat, **fields).param == param


# ---------------------------------------------------------------------------- the docs' table

def documented_fields():
    """{field: endpoints column} of docs/clients.md's table of request fields."""
    page = (ROOT / "docs" / "clients.md").read_text()
    section = page.split("## Every request field", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([a-z, ]+) \|", section, re.M)
    assert rows, "docs/clients.md has no table of request fields"
    return {name: set(endpoints.replace(" ", "").split(",")) for name, endpoints in rows}


def test_the_docs_table_lists_exactly_the_fields_of_the_schema():
    """A field added to a model without a row (or a row left for a field removed) fails here."""
    schema = {}
    for endpoint, model in (("completions", CompletionRequest), ("chat", ChatRequest)):
        for name in fields_of(model):
            schema.setdefault(name, set()).add(endpoint)
    assert documented_fields() == schema
