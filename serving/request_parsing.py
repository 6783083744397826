"""
Reading a request: each endpoint's JSON body (already parsed by server.read_body) checked
field by field and turned into what the engine takes, one function per endpoint:

    parse_completion   /v1/completions       -> Parsed (prompts as token ids, SamplingParams)
    parse_chat         /v1/chat/completions  -> Parsed (the messages rendered by the template)
    parse_tokenize     /tokenize             -> token ids
    parse_detokenize   /detokenize           -> token ids

Anything wrong raises BadRequest, which the server answers with HTTP 400 (or the status it
names) and OpenAI's error object naming the field (param) and why (code). A request's size
is held to the admission limits (admission.py) before its text is encoded; the engine
checks again when the work is submitted. The answers are shaped in replies.py.
"""

import json
from dataclasses import dataclass

from plumbing.user_text import TextError, as_prompt, check_text, encode_text, longest_token_bytes
from serving.chat import ROLES, TemplateError
from serving.requests import SamplingParams

MAX_N = 128          # samples per prompt
MAX_STOPS = 4        # as OpenAI
MAX_LOGPROBS = 20    # top log-probabilities per token, as vLLM's default and OpenAI's chat
MAX_STOP_TOKEN_IDS = 64
UNSUPPORTED = {      # fields we do not implement, and the value that means "not used"
    "best_of": 1, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
    "logit_bias": None,
}
CHAT_UNSUPPORTED = {  # the same for chat: no tools, no structured output, text only
    **{k: v for k, v in UNSUPPORTED.items() if k not in ("best_of", "suffix")},
    "tools": None, "tool_choice": None, "functions": None, "function_call": None,
    "response_format": {"type": "text"}, "audio": None, "prediction": None,
}


class BadRequest(Exception):
    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass
class Parsed:
    """What a completion or chat request asks for."""
    prompts: list        # token ids of each prompt
    samples: list        # SamplingParams of each of the n samples of a prompt
    stream: bool
    include_usage: bool
    logprobs: bool       # the choices carry logprobs
    echo: bool = False   # (completions) the text starts with the prompt


# ---------------------------------------------------------------------------- the endpoints

def parse_completion(body, tokenizer, context, model_name, limits, policy="error"):
    """A Parsed /v1/completions request. logprobs: k gives every new token's
    log-probability and the k likeliest; echo returns the prompt too (with logprobs, its
    tokens' log-probabilities); max_tokens 0 with echo scores the prompt only. The
    request's size is held to the admission limits before its prompts are encoded."""
    check_model(body, model_name)
    refuse_unsupported(body, UNSUPPORTED)
    prompts = prompt_list(body)
    logprobs, echo = logprobs_count(body, "logprobs"), flag(body, "echo")
    max_tokens = number(body, "max_tokens", 16, 0, 10**6, integer=True)
    if max_tokens == 0 and not echo:
        raise BadRequest("'max_tokens' must be >= 1 (0 only with echo, to score the prompt)",
                         "max_tokens", "invalid_value")
    fields, n, seed, stream, include_usage = sampling_fields(body, tokenizer, context)
    check_size(limits, len(prompts), n, max_tokens)
    prompts = prompt_ids(prompts, tokenizer, context, limits)
    for p in prompts:
        check_fits_context(len(p), max_tokens, context, "prompt", policy)
    fields.update(max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=logprobs if echo and logprobs is not None else None)
    return Parsed(prompts, samples_of(fields, n, seed), stream, include_usage,
                  logprobs is not None, echo)


def parse_chat(body, tokenizer, context, model_name, template, limits, policy="error"):
    """A Parsed /v1/chat/completions request. Generation stops at the template's
    end-of-turn tokens (with the end-of-text, and ignored with it by ignore_eos, as vLLM
    treats a model's end-of-sequence ids)."""
    check_model(body, model_name)
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    fields, n, seed, stream, include_usage = sampling_fields(body, tokenizer, context)
    limits.check_sequences(1, n)  # before the template renders and the text is encoded
    prompt = chat_prompt(body, template, tokenizer, context)
    limits.check_prompt_tokens(len(prompt))
    if len(prompt) >= context and policy == "error":
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, your "
                         f"messages resulted in {len(prompt)} tokens, which leaves no room for a "
                         "reply. Please reduce the length of the messages.", "messages",
                         "context_length_exceeded")
    if len(prompt) > context:
        raise BadRequest(f"This model's maximum context length is {context} tokens; the messages "
                         f"have {len(prompt)}", "messages", "context_length_exceeded")
    max_tokens = number(body, "max_completion_tokens", None, 1, 10**6, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", None, 1, 10**6, integer=True)
    if max_tokens is None:  # as vLLM: what the context has room for
        max_tokens = max(context - len(prompt), 1)
    check_fits_context(len(prompt), max_tokens, context, "messages", policy)
    check_size(limits, 1, n, max_tokens)
    logprobs, top = flag(body, "logprobs"), logprobs_count(body, "top_logprobs")
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if fields["stop_at_eot"]:
        fields["stop_token_ids"] += template.end_of_turn_ids
    fields.update(max_tokens=max_tokens, logprobs=(top or 0) if logprobs else None)
    return Parsed([prompt], samples_of(fields, n, seed), stream, include_usage, logprobs)


def parse_tokenize(body, tokenizer, context, model_name, template):
    """/tokenize, as vLLM's: {"prompt": text} or {"messages": [...]} (rendered by the chat
    template, which writes its own BOS). A prompt's ids begin with the tokenizer's BOS when
    its config adds one (as /v1/completions feeds it), unless "add_special_tokens" is false."""
    check_model(body, model_name)
    if "messages" in body:
        return chat_prompt(body, template, tokenizer, context)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' (a string) or 'messages' is required", "prompt", "invalid_type")
    add_special_tokens = body.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise BadRequest("'add_special_tokens' must be true or false", "add_special_tokens", "invalid_type")
    ids = user_text_ids(prompt, tokenizer, context, "prompt")
    bos = getattr(tokenizer, "bos_token_id", None) if add_special_tokens else None
    return ids if bos is None else [bos, *ids]


def parse_detokenize(body, tokenizer, model_name):
    """/detokenize, as vLLM's: {"tokens": [ids]}, each a token of the tokenizer."""
    check_model(body, model_name)
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(map(is_json_int, ids))):
        raise BadRequest("'tokens' must be a list of token ids", "tokens", "invalid_type")
    if not all(0 <= t < tokenizer.n_vocab for t in ids):
        raise BadRequest(f"token ids must be in [0, {tokenizer.n_vocab})", "tokens", "invalid_value")
    return ids


# ---------------------------------------------------------------------------- the fields

def shown(value):
    """A client's value in an error message: JSON, cut to a few dozen characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_json_int(x):
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a number


def is_json_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def number(body, name, default, low, high, integer=False, low_open=False):
    """body[name] (null: the default) checked to be a number in [low, high] ((low, high]
    with low_open); one BadRequest naming the field otherwise."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if not (is_json_int(value) if integer else is_json_number(value)):
        raise BadRequest(f"'{name}' must be {kind}, got {shown(value)}", name, "invalid_type")
    if value != value or value > high or (value <= low if low_open else value < low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"'{name}' must be in {interval}, got {shown(value)}", name, "invalid_value")
    return value


def flag(body, name):
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {shown(value)}", name, "invalid_type")
    return value


def stop_strings(body, tokenizer, context):
    """At most MAX_STOPS strings, of at most context x longest_token_bytes characters in
    all: a stop string matches text the sample writes, and a context's worth of tokens is
    at most that many characters (a character is at least one byte), so a longer one could
    never match within a context (past it, with --context-policy reprefill, only text whose
    start the model no longer sees). Every sample builds a matching table for each string
    before its first token, on the server's time: without the bound four strings of 250,000
    characters and n 64 held up every other client for seconds."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(stop) > MAX_STOPS:
        raise BadRequest(f"'stop' takes at most {MAX_STOPS} strings, got {len(stop)}", "stop", "invalid_value")
    longest = longest_token_bytes(tokenizer)
    total = sum(map(len, stop))
    if longest is not None and total > context * longest:
        raise BadRequest(f"'stop' strings have {total:,} characters in all; at most "
                         f"{context * longest:,} (the most text a context of {context} tokens can "
                         "hold) can ever match", "stop", "invalid_value")
    return tuple(stop)


def logprobs_count(body, name):
    """How many top log-probabilities a request asks for: null (none) or 0..MAX_LOGPROBS."""
    return number(body, name, None, 0, MAX_LOGPROBS, integer=True)


def stop_token_ids(body, tokenizer):
    """The vLLM extra 'stop_token_ids': token ids that end the text."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not (isinstance(ids, list) and all(map(is_json_int, ids))):
        raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t < tokenizer.n_vocab for t in ids):
        raise BadRequest(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids in "
                         f"[0, {tokenizer.n_vocab})", "stop_token_ids", "invalid_value")
    return tuple(ids)


def check_model(body, model_name):
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:  # null or absent: the one served, as vLLM
        raise BadRequest(f"The model {shown(model)} does not exist; this server serves '{model_name}'",
                         "model", "model_not_found")


def refuse_unsupported(body, unsupported):
    for name, unused in unsupported.items():
        if body.get(name, unused) not in (unused, None):
            raise BadRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def sampling_fields(body, tokenizer, context):
    """(SamplingParams fields every endpoint shares, n, seed, stream, include_usage)."""
    top_k = number(body, "top_k", None, -1, 10**9, integer=True)
    if top_k == 0:
        raise BadRequest("'top_k' must be -1 (off) or >= 1, got 0", "top_k", "invalid_value")
    top_p = number(body, "top_p", 1.0, 0, 1, low_open=True)
    seed = number(body, "seed", None, -2**63, 2**63 - 1, integer=True)
    fields = dict(temperature=number(body, "temperature", 1.0, 0, 2),
                  top_k=None if top_k in (None, -1) else top_k,
                  top_p=None if top_p == 1 else top_p,
                  stop=stop_strings(body, tokenizer, context), stop_token_ids=stop_token_ids(body, tokenizer),
                  stop_at_eot=not flag(body, "ignore_eos"))
    n = number(body, "n", 1, 1, MAX_N, integer=True)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    return fields, n, seed, flag(body, "stream"), flag(options, "include_usage")


def samples_of(fields, n, seed):
    """The SamplingParams of n samples: sample i of n draws from seed + i, so the n texts
    differ and each is reproducible."""
    return [SamplingParams(**fields, seed=None if seed is None else seed + i) for i in range(n)]


def check_size(limits, num_prompts, n, max_tokens):
    """The request's size against the admission limits (admission.py), before any work:
    encoding, sampling state. The engine checks again when the work is submitted."""
    limits.check_sequences(num_prompts, n)
    limits.check_new_tokens(num_prompts * n * max_tokens, num_prompts * n)


def check_fits_context(prompt_len, max_tokens, context, param, policy):
    """Refuse a prompt plus max_tokens past the context, as OpenAI and vLLM do; with the
    policy "reprefill" the engine keeps going past it instead."""
    if policy == "error" and prompt_len + max_tokens > context:
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, you "
                         f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                         f"{param}, {max_tokens} in the completion). Please reduce the length of "
                         f"the {param} or completion (or start serve.py with --context-policy "
                         "reprefill to keep going past the context).", param, "context_length_exceeded")


# ---------------------------------------------------------------------------- prompts

def prompt_list(body):
    """The prompts of the request, each a string or a list of token ids: 'prompt' is a
    string, a list of strings, a list of token ids, or a list of such lists (OpenAI's four
    forms)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(is_json_int, prompt))):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(map(is_json_int, p))) for p in prompt)):
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or "
                         "a list of lists of token ids, and not empty", "prompt", "invalid_type")
    return prompt


def check_user_text(text, tokenizer, context, param):
    """Refuse a client's text that cannot be tokenized (a lone surrogate), or that has more
    characters than the context's tokens could ever hold (before it is encoded: a million
    characters of whitespace is also what makes tiktoken panic)."""
    longest = longest_token_bytes(tokenizer)  # a character is at least one byte
    if longest is not None and len(text) > context * longest:
        raise BadRequest(f"This model's maximum context length is {context} tokens; the "
                         f"{param} has more", param, "context_length_exceeded")
    try:
        check_text(text)
    except TextError as e:
        raise BadRequest(f"'{param}': {e}", param, "invalid_value") from None


def user_text_ids(text, tokenizer, context, param):
    """Token ids of a client's text (plumbing.user_text: hostile text never panics the
    tokenizer), checked first (check_user_text)."""
    check_user_text(text, tokenizer, context, param)
    return encode_text(tokenizer, text)


def prompt_ids(prompts, tokenizer, context, limits):
    """The prompts as lists of token ids, each within the context and all together within
    the request's prompt tokens (limits), checked as they are encoded. A string begins as
    generate.py's do (user_text.as_prompt: after the tokenizer's BOS when its config adds
    one; an empty one is the end-of-text token); token ids are fed as they are."""
    ids, total = [], 0
    for p in prompts:
        if isinstance(p, str):
            p = as_prompt(tokenizer, user_text_ids(p, tokenizer, context, "prompt"))
        elif not all(0 <= t < tokenizer.n_vocab for t in p):
            raise BadRequest(f"token ids must be in [0, {tokenizer.n_vocab})", "prompt", "invalid_value")
        if len(p) > context:
            raise BadRequest(f"This model's maximum context length is {context} tokens; "
                             f"the prompt has {len(p)}", "prompt", "context_length_exceeded")
        total += len(p)
        limits.check_prompt_tokens(total)
        ids.append(p)
    return ids


# ---------------------------------------------------------------------------- chat messages

def message_text(content, i):
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': "
                             "...}) are supported", "messages", "unsupported_parameter")
        return "".join(p["text"] for p in content)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                     "messages", "invalid_type")


def chat_messages(body):
    """The messages as the template reads them: [{"role", "content"}], content as text."""
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", "messages", "missing_required_parameter")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise BadRequest("'messages' must be a non-empty list of {'role': ..., 'content': ...}",
                         "messages", "invalid_type")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                             f"{shown(m.get('role'))}", "messages", "invalid_value")
    return [{"role": m["role"], "content": message_text(m.get("content"), i)}
            for i, m in enumerate(messages)]


def chat_prompt(body, template, tokenizer, context):
    """Token ids of the conversation, rendered by the model's chat template. The rendered
    text passes the same checks as a prompt's (user_text_ids) before it is encoded."""
    if template is None:
        raise BadRequest("This model has no chat template, so /v1/chat/completions cannot "
                         "render messages: start serve.py with --chat-template FILE (a Jinja "
                         "template), or serve a --hf directory whose tokenizer_config.json has a "
                         "chat_template; /v1/completions works without one", "messages",
                         "chat_template_missing")
    messages = chat_messages(body)
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise BadRequest("'add_generation_prompt' must be true or false", "add_generation_prompt",
                         "invalid_type")
    try:
        text = template.render(messages, add_generation_prompt)
    except TemplateError as e:
        raise BadRequest(f"the chat template refused these messages: {e}", "messages",
                         "invalid_value") from None
    check_user_text(text, tokenizer, context, "messages")
    return template.encode(text)
