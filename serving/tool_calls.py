"""
Tool calls in chat completions: what a request's `tools` and `tool_choice` ask of the reply,
and the calls read back out of the text the model wrote.

A model calls a tool by writing text in the shape its chat template taught it, and the
server turns that text into OpenAI's `message.tool_calls`:

    tool_choice "required"   the reply is held to a JSON schema (the structured-output
                             constraint): an array of {"name": one of the tools, "parameters":
                             that tool's schema}, at least one (exactly one without
                             parallel_tool_calls), as vLLM builds it
    a named tool             held to that tool's parameters schema: the text is the arguments
    "auto"                   unconstrained; the text is read for calls in either family's shape:
                               Qwen 2.5/3, Hermes:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                               Llama 3.1-3.3:       {"name": ..., "parameters": {...}}  (the whole
                                                    reply, optionally after <|python_tag|>, several
                                                    separated by ";")
                             a reply that is neither (or names a tool not offered) is content
    "none"                   the tools are in the prompt, the reply is content (vLLM's default)

ToolUse holds a request's side; ToolCallText reads one choice's text, as it streams:
content is handed out as soon as it cannot be the start of a call, and the calls at the end.
"""

import json
import re
import uuid

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"   # Llama 3.1's marker before a call
HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolUse:
    def __init__(self, tools, choice, parallel=True):
        """tools: OpenAI's [{"type": "function", "function": {name, description, parameters}}]
        (as the chat template reads them); choice: "auto", "none", "required" or a tool's
        name; parallel: whether a reply may call more than one."""
        self.tools, self.choice, self.parallel = tools, choice, parallel
        self.parameters = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS
                           for t in tools}

    def schema(self):
        """The JSON schema the reply is held to (None: not held)."""
        if self.choice in ("auto", "none"):
            return None
        if self.choice != "required":
            return self.parameters[self.choice]
        one_call = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                      "parameters": parameters},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for name, parameters in self.parameters.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": {"anyOf": one_call}}

    def reader(self):
        """A ToolCallText for one choice, or None when the reply is content whatever it says."""
        return None if self.choice == "none" else ToolCallText(self)

    def calls_in(self, text):
        """(content, calls) of a reply's text: calls in OpenAI's shape, [] when it has none."""
        if self.choice == "required":
            found = as_calls(loads(text), self.parameters, argument_keys=("parameters",))
        elif self.choice != "auto":
            arguments = loads(text)
            found = [(self.choice, arguments)] if isinstance(arguments, dict) else None
        elif HERMES_OPEN in text:
            start = text.index(HERMES_OPEN)
            blocks = [loads(b) for b in HERMES_BLOCK.findall(text, start)]
            found = as_calls(blocks, self.parameters)
            if found:
                return text[:start], self.shaped(found)
        else:
            found = as_calls(json_values(text.strip().removeprefix(PYTHON_TAG)), self.parameters)
        return ("", self.shaped(found)) if found else (text, [])

    def shaped(self, found):
        """[(name, arguments)] as OpenAI's tool_calls (arguments a JSON string); the first
        only without parallel_tool_calls."""
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                for name, arguments in found[:None if self.parallel else 1]]


def loads(text):
    """The JSON value of text, or None."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def json_values(text):
    """The JSON values of text written one after another (Llama 3.2 separates calls with
    ";"), flattened one level (a list of calls); None if any part is not JSON."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])
        while at < len(text) and text[at] in " \t\n\r;":
            at += 1
    return values or None


def as_calls(values, parameters, argument_keys=("arguments", "parameters")):
    """[(name, arguments)] when every value is a call of an offered tool, else None."""
    if not isinstance(values, list) or not values:
        return None
    calls = []
    for value in values:
        if not (isinstance(value, dict) and value.get("name") in parameters):
            return None
        arguments = next((value[k] for k in argument_keys if k in value), None)
        if not isinstance(arguments, dict):
            return None
        calls.append((value["name"], arguments))
    return calls


class ToolCallText:
    """One choice's text read for tool calls as it streams: add(piece) returns the content
    that can go out now; end() the rest of the content and the calls."""

    def __init__(self, use):
        self.use, self.text, self.sent = use, "", 0

    def add(self, piece):
        self.text += piece
        ready = max(self.ready_length(), self.sent)
        out, self.sent = self.text[self.sent:ready], ready
        return out

    def end(self):
        content, calls = self.use.calls_in(self.text)
        return content[self.sent:], calls

    def ready_length(self):
        """How much of the text cannot be part of a call: none when the reply is the call
        (forced) or may still begin as one (JSON, Llama's tag); else up to <tool_call>,
        holding back an end that may be the start of one."""
        head = self.text.lstrip()
        if self.use.choice != "auto" or any(m.startswith(head[:len(m)]) for m in ("{", "[", PYTHON_TAG)):
            return 0
        start = self.text.find(HERMES_OPEN)
        if start >= 0:
            return start
        partial = next((k for k in range(len(HERMES_OPEN) - 1, 0, -1)
                        if self.text.endswith(HERMES_OPEN[:k])), 0)
        return len(self.text) - partial
