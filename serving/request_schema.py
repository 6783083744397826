"""
The request bodies the server accepts, as pydantic models: one class per endpoint, one
line per field, so that what a client may send is read here and nowhere else.

    CompletionRequest   /v1/completions
    ChatRequest         /v1/chat/completions (its messages, tools, tool_choice ...)
    TokenizeRequest     /tokenize
    DetokenizeRequest   /detokenize

Every model forbids fields it does not name: an unknown field is a 400 naming it, with the
list of the fields the endpoint takes (a misspelt `temprature` must not be silently
ignored). A field we know but do not implement (`best_of`, `audio`, ...) is typed
`unsupported(unused)`: accepted at its "not used" value, a 400 otherwise. Types are strict:
JSON's true is not the number 1, "7" is not 7.

validate(Model, body) runs the model and turns the first error pydantic finds into one
BadRequest: param is the top-level field, the message says where inside it
(`messages[2].tool_call_id`) and what was wanted. What needs the tokenizer or the model
(token ids in the vocabulary, the context, stop strings' total) is checked after, in
request_parsing.py, and the constraint itself (a schema the grammar engine cannot compile)
by SamplingParams.check().
"""

import json
from typing import Annotated, Any, Literal, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      model_validator)
from pydantic_core import PydanticCustomError

from serving.chat import ROLES

MAX_N = 128          # samples per prompt
MAX_STOPS = 4        # as OpenAI
MAX_LOGPROBS = 20    # top log-probabilities per token, as vLLM's default and OpenAI's chat
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024     # entries of logit_bias (OpenAI documents 300; a few more is free)
MAX_BAD_WORDS = 128
MAX_TOOLS = 128           # as OpenAI
MAX_SPEC_CHARS = 100_000  # a schema, regex, grammar or choice list, as JSON: the grammar
                          # engine's compile time grows with it (real ones are a few KB)
MAX_TEMPLATE_KWARGS_CHARS = 16_384  # chat_template_kwargs, as JSON (Qwen3's is 30 characters)


class BadRequest(Exception):
    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def shown(value):
    """A client's value in an error message: JSON, cut to a few dozen characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse(code, message):
    """A validation error of ours: code is OpenAI's (invalid_value, invalid_type, ...);
    the message follows the field's name."""
    return PydanticCustomError(code, message)


# ---------------------------------------------------------------------------- field types

def in_range(low, high, low_open=False):
    """A validator: the number in [low, high] ((low, high] with low_open); NaN is not."""
    def check(value):
        if value != value or value > high or (value <= low if low_open else value < low):
            raise refuse("invalid_value", f"must be in {'(' if low_open else '['}{low}, {high}]"
                         f", got {shown(value)}")
        return value
    return AfterValidator(check)


def Int(low, high):
    return Optional[Annotated[int, in_range(low, high)]]


def Number(low, high, low_open=False):
    return Optional[Annotated[float, in_range(low, high, low_open)]]


def unsupported(unused):
    """A field we know and do not implement: its "not used" value (or null) passes, any
    other is refused by name rather than ignored."""
    def check(value):
        if value not in (unused, None):
            raise refuse("unsupported_parameter", "is not supported by this server")
        return value
    return Annotated[Any, AfterValidator(check)]


def spec_size(value):
    """A constraint's spec (schema, regex, grammar, choices) bounded as JSON."""
    if value is not None and len(json.dumps(value)) > MAX_SPEC_CHARS:
        raise refuse("invalid_value", f"is larger than {MAX_SPEC_CHARS:,} characters as JSON")
    return value


def json_schema(value):
    """A JSON schema: an object."""
    if not isinstance(value, dict):
        raise refuse("invalid_type", f"must be a JSON schema (an object), got {shown(value)}")
    return spec_size(value)


def json_schema_or_text(value):
    """vLLM's guided_json and structured_outputs.json: a schema, or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise refuse("invalid_value", "is not valid JSON") from None
    return json_schema(value)


def spec_text(value):
    """A regex or a grammar: a non-empty string, bounded."""
    if not value:
        raise refuse("invalid_value", "must not be empty")
    return spec_size(value)


def choices(value):
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise refuse("invalid_value", "must be a non-empty list of non-empty strings")
    return spec_size(value)


Schema = Optional[Annotated[Any, AfterValidator(json_schema)]]
SchemaOrText = Optional[Annotated[Any, AfterValidator(json_schema_or_text)]]
SpecText = Optional[Annotated[str, AfterValidator(spec_text)]]
Choices = Optional[Annotated[Any, AfterValidator(choices)]]


def stop_list(value):
    """'stop': a string or a list of at most MAX_STOPS non-empty strings, as a list."""
    value = [value] if isinstance(value, str) else value
    if not (isinstance(value, list) and all(isinstance(s, str) and s for s in value)):
        raise refuse("invalid_type", "must be a non-empty string or a list of them")
    if len(value) > MAX_STOPS:
        raise refuse("invalid_value", f"takes at most {MAX_STOPS} strings, got {len(value)}")
    return value


def is_ids(value):
    return (isinstance(value, list) and value and
            all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def prompt_list(value):
    """'prompt': a string, a list of strings, a list of token ids, or a list of such lists
    (OpenAI's four forms), as a list of prompts."""
    if isinstance(value, str) or is_ids(value):
        value = [value]
    if not (isinstance(value, list) and value and all(isinstance(p, str) or is_ids(p) for p in value)):
        raise refuse("invalid_type", "must be a string, a list of strings, a list of token ids or "
                     "a list of lists of token ids, and not empty")
    return value


def bias_table(value):
    """OpenAI's logit_bias: {"token id": bias}, bias in [-100, 100]."""
    if len(value) > MAX_LOGIT_BIAS:
        raise refuse("invalid_value", f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    for key, bias in value.items():
        if not key.strip().isdigit():
            raise refuse("invalid_value", f"keys are token ids (strings of digits), got {shown(key)}")
        if not -100 <= bias <= 100:  # NaN fails too
            raise refuse("invalid_value", f"biases are in [-100, 100], got {shown(bias)}")
    return value


class Strict(BaseModel):
    """Every model: unknown fields refused, no type coercion."""
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------- structured output

class JsonSchemaFormat(Strict):
    """OpenAI's response_format.json_schema. strict false is enforced too (as vLLM does):
    the grammar is the schema either way."""
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Optional[str] = None
    schema_: Schema = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: one of these."""
    json_: SchemaOrText = Field(None, alias="json")
    regex: SpecText = None
    choice: Choices = None
    grammar: SpecText = None
    json_object: Optional[bool] = None


class StreamOptions(Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: the usage so far on every chunk


# ---------------------------------------------------------------------------- the endpoints

class Sampling(Strict):
    """The fields both generating endpoints take (the names are OpenAI's, then vLLM's)."""
    model: Optional[str] = None
    temperature: Number(0, 2) = None
    top_p: Number(0, 1, low_open=True) = None
    top_k: Int(-1, 10**9) = None     # 0 and -1: off (vLLM, llama.cpp)
    min_p: Number(0, 1) = None
    n: Int(1, MAX_N) = None
    seed: Int(-2**63, 2**63 - 1) = None
    stop: Optional[Annotated[Any, AfterValidator(stop_list)]] = None
    stop_token_ids: Optional[Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    include_stop_str_in_output: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Number(-2, 2) = None
    frequency_penalty: Number(-2, 2) = None
    repetition_penalty: Number(0, 10, low_open=True) = None
    logit_bias: Optional[Annotated[dict[str, float], AfterValidator(bias_table)]] = None
    min_tokens: Int(0, 10**6) = None
    bad_words: Optional[Annotated[list[Annotated[str, Field(min_length=1, max_length=1000)]],
                                  Field(max_length=MAX_BAD_WORDS)]] = None
    allowed_token_ids: Optional[Annotated[list[int], Field(min_length=1)]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: SchemaOrText = None
    guided_regex: SpecText = None
    guided_choice: Choices = None
    guided_grammar: SpecText = None
    user: Optional[str] = None  # OpenAI's end-user id, for their abuse monitoring: kept nowhere


class CompletionRequest(Sampling):
    prompt: Annotated[Any, AfterValidator(prompt_list)] = None  # None: refused as missing
    max_tokens: Int(0, 10**6) = None  # 0 only with echo (request_parsing checks)
    logprobs: Int(0, MAX_LOGPROBS) = None
    echo: Optional[bool] = None
    best_of: unsupported(1) = None
    suffix: unsupported(None) = None


# ---------------------------------------------------------------------------- chat

def message_content(value):
    """A message's content: a string, a list of text parts, or null (an assistant's message
    that only calls tools)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in value):
            raise refuse("unsupported_parameter", "only text parts ({'type': 'text', 'text': ...}) "
                         "are supported")
        return "".join(p["text"] for p in value)
    raise refuse("invalid_type", "must be a string or a list of text parts")


def arguments_text(value):
    """A tool call's arguments: a JSON string (OpenAI's shape) or an object."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise refuse("invalid_type", "must be a JSON string")
    return value


class FunctionCall(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Annotated[Any, AfterValidator(arguments_text)]


class ToolCall(Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal[ROLES]
    content: Annotated[Any, AfterValidator(message_content)] = None
    name: Optional[str] = None
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)]] = None
    tool_call_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    reasoning_content: Optional[str] = None  # a thinking model's reasoning (Qwen3's templates read it)

    @model_validator(mode="after")
    def roles_needs(self):
        """What each role needs: a tool's answer says which call it answers; only an
        assistant calls tools, and only it may leave content out (when it does)."""
        if self.role == "tool" and self.tool_call_id is None:
            raise refuse("invalid_value", "is a 'tool' message: it needs 'tool_call_id' (the id of "
                         "the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise refuse("invalid_value", "has 'tool_calls': only an 'assistant' message calls tools")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refuse("invalid_type", "needs 'content': a string or a list of text parts")
        return self


def non_empty_list(value):
    if not (isinstance(value, list) and value and all(isinstance(m, dict) for m in value)):
        raise refuse("invalid_type", "must be a non-empty list of {'role': ..., 'content': ...}")
    return value


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
    description: Optional[Annotated[str, Field(max_length=4096)]] = None
    parameters: Schema = None  # null: a function that takes no arguments
    strict: Optional[bool] = None  # enforced either way when the call is required


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


def tool_choice_of(value):
    """"none", "auto", "required", or {"type": "function", "function": {"name": ...}}."""
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        return NamedToolChoice.model_validate(value)
    raise refuse("invalid_value", 'must be "none", "auto", "required" or {"type": "function", '
                 f'"function": {{"name": ...}}}}, got {shown(value)}')


RESERVED_TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                           "raise_exception", "strftime_now")


def template_kwargs(value):
    """chat_template_kwargs: extra variables for the template (Qwen3's enable_thinking),
    bounded, never one the server sets itself."""
    if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise refuse("invalid_value", f"is larger than {MAX_TEMPLATE_KWARGS_CHARS:,} characters as JSON")
    for key in value:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_NAMES:
            raise refuse("invalid_value", f"cannot set {shown(key)} (a variable must be a name, "
                         f"and not one of {', '.join(RESERVED_TEMPLATE_NAMES)})")
    return value


class ChatRequest(Sampling):
    messages: Annotated[list[Message], BeforeValidator(non_empty_list)] = None  # None: missing
    max_tokens: Int(1, 10**6) = None
    max_completion_tokens: Int(1, 10**6) = None
    logprobs: Optional[bool] = None
    top_logprobs: Int(0, MAX_LOGPROBS) = None
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Annotated[Any, AfterValidator(tool_choice_of)]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Annotated[dict[str, Any], AfterValidator(template_kwargs)]] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    functions: unsupported(None) = None       # OpenAI's old names for tools
    function_call: unsupported(None) = None
    audio: unsupported(None) = None
    modalities: unsupported(["text"]) = None
    prediction: unsupported(None) = None
    reasoning_effort: unsupported(None) = None
    web_search_options: unsupported(None) = None
    store: unsupported(False) = None
    metadata: unsupported(None) = None


class TokenizeRequest(Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[Message], BeforeValidator(non_empty_list)]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: Optional[bool] = None  # vLLM's: each token's text beside its id


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: list[int]


# ---------------------------------------------------------------------------- errors

TYPE_NAMES = {"int_type": "an integer", "bool_type": "true or false", "float_type": "a number",
              "string_type": "a string", "list_type": "a list", "dict_type": "an object",
              "model_type": "an object", "model_attributes_type": "an object"}
OUR_CODES = ("invalid_value", "invalid_type", "unsupported_parameter")


def where(loc):
    """('messages', 2, 'content') -> messages[2].content"""
    text = str(loc[0])
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def fields_of(model):
    """The names a client may send to an endpoint (aliases: `schema`, not `schema_`)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def bad_request(error, model):
    """One pydantic error (a dict of ValidationError.errors()) as a BadRequest."""
    kind, loc, value = error["type"], error["loc"], error.get("input")
    param, at = str(loc[0]) if loc else None, where(loc) if loc else "the body"
    if kind in OUR_CODES:
        return BadRequest(f"'{at}' {error['msg']}", param, kind)
    if kind == "extra_forbidden" and len(loc) == 1:
        return BadRequest(f"'{at}' is not a field of this endpoint; it takes "
                          f"{', '.join(fields_of(model))}", param, "unknown_parameter")
    if kind == "extra_forbidden":
        return BadRequest(f"'{at}' is not a field this server knows", param, "unknown_parameter")
    if kind == "missing":
        return BadRequest(f"'{at}' is required", param, "missing_required_parameter")
    if kind in TYPE_NAMES:
        return BadRequest(f"'{at}' must be {TYPE_NAMES[kind]}, got {shown(value)}", param, "invalid_type")
    if kind in ("too_long", "too_short"):  # the value itself would say nothing more
        return BadRequest(f"'{at}': {error['msg']}", param, "invalid_value")
    if kind == "literal_error":
        return BadRequest(f"'{at}' must be one of {error['ctx']['expected']}, got {shown(value)}",
                          param, "invalid_value")
    return BadRequest(f"'{at}': {error['msg']}, got {shown(value)}", param, "invalid_value")


def validate(model, body):
    """body (parsed JSON) as an instance of model, or the first error as a BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(e.errors(include_url=False)[0], model) from None
