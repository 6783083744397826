"""
An OpenAI-compatible HTTP server on the engine (the command is serve.py):

    POST /v1/completions   prompt (a string, a list of strings, or token ids), max_tokens
                           (0 with echo: score the prompt only), temperature, top_p, top_k
                           (an extra, as in vLLM; -1 = off), n, stop, seed, stream
                           (server-sent events), stream_options, logprobs (0-20), echo,
                           ignore_eos and stop_token_ids (extras, as in vLLM)
    POST /v1/chat/completions  messages, rendered with the model's chat template
                           (chat.py), max_tokens / max_completion_tokens, logprobs and
                           top_logprobs, and the sampling fields above
    POST /tokenize, /detokenize   text <-> token ids (vLLM's extras)
    GET  /v1/models        the one model served, with max_model_len
    GET  /metrics          Prometheus's text format (metrics.py)
    GET  /health           {"status": "ok"} and the engine's counters (blocks free, ...)

With an API key (serve.py --api-key), every path but /health wants the header
`Authorization: Bearer KEY` and answers 401 without it. A prompt plus max_tokens longer
than the model's context is refused (400, naming both), as OpenAI and vLLM do, unless the
server keeps going past the context (context_policy "reprefill", the generation loop's
policy). The answers are shaped in replies.py.

The HTTP side (aiohttp, on an asyncio event loop in its own thread) and the engine
(serve.py runs it on the main thread) meet in two places: engine.submit /
engine.cancel, and on_output, which the engine calls from its thread and which puts each
Output on the request's asyncio.Queue, through HandOut: one loop.call_soon_threadsafe for
all the Outputs of a step, not one each. A client that
goes away is noticed by aiohttp (the handler is cancelled, or its next write fails) and
its requests are cancelled at once: their blocks return to the pool at the engine's next
step.

Bad requests get HTTP 400 and OpenAI's error object:
    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
So does every body before any endpoint reads it (read_body: compressed, not JSON, nested
too deep: 400 or 415), and a request past the admission limits (admission.py: 400 naming
the limit, or 429 with Retry-After when the waiting queue is full). Engine.submit is the
only way work enters the engine, so no endpoint can skip the limits.
"""

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

from aiohttp import web

from plumbing.user_text import TextError, as_prompt, check_text, encode_text, longest_token_bytes
from serving.admission import Overloaded, RequestTooLarge
from serving.chat import ROLES, TemplateError
from serving.engine import SamplingParams
from serving.metrics import ServerMetrics
from serving.replies import ChatReply, CompletionReply, EngineFailed

MAX_N = 128          # samples per prompt
MAX_STOPS = 4        # as OpenAI
MAX_LOGPROBS = 20    # top log-probabilities per token, as vLLM's default and OpenAI's chat
MAX_STOP_TOKEN_IDS = 64
MAX_JSON_DEPTH = 64  # a real request nests 3 to 6 deep; 1,000 deep broke json.loads itself
BODY = web.RequestKey("body", object)  # request[BODY]: the parsed JSON body (read_body)
UNSUPPORTED = {      # fields we do not implement, and the value that means "not used"
    "best_of": 1, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
    "logit_bias": None,
}
CHAT_UNSUPPORTED = {  # the same for chat: no tools, no structured output, text only
    **{k: v for k, v in UNSUPPORTED.items() if k not in ("best_of", "suffix")},
    "tools": None, "tool_choice": None, "functions": None, "function_call": None,
    "response_format": {"type": "text"}, "audio": None, "prediction": None,
}
OPEN_PATHS = ("/health",)  # answered without the API key
CONTEXT_POLICIES = ("error", "reprefill")


class BadRequest(Exception):
    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_response(status, message, param=None, code=None, kind="invalid_request_error"):
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def api_key_check(api_key):
    """A middleware that answers 401 unless the request carries `Authorization: Bearer
    api_key` (compared in constant time; the key is never written anywhere)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request, handler):
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if request.path in OPEN_PATHS or hmac.compare_digest(given, expected):
            return await handler(request)
        return error_response(401, "Incorrect or missing API key: send the header "
                              "'Authorization: Bearer <key>' with the key the server was "
                              "started with", code="invalid_api_key")
    return check


@web.middleware
async def openai_errors(request, handler):
    """Every failure as OpenAI's error object; nothing a client sends can stop the server."""
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(e.status, str(e), e.param, e.code)
    except RequestTooLarge as e:  # past a per-request admission limit
        return error_response(400, str(e), e.param, e.code)
    except Overloaded as e:
        response = error_response(429, str(e), kind="rate_limit_error", code="server_busy")
        response.headers["Retry-After"] = str(e.retry_after)
        return response
    except web.HTTPException as e:  # unknown path (404), wrong method (405), body too large (413)
        if e.status < 400:
            raise
        return error_response(e.status, f"{e.reason}: {request.method} {request.path}")
    except EngineFailed as e:
        return error_response(500, str(e), kind="server_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nobody to answer
    except Exception as e:
        traceback.print_exc()
        return error_response(500, f"internal error: {type(e).__name__}", kind="server_error")


# ---------------------------------------------------------------------------- reading a request

@web.middleware
async def read_body(request, handler):
    """Every POST body, read and parsed before any endpoint sees it: request[BODY] is
    JSON nested at most MAX_JSON_DEPTH deep. Refused: a compressed body (aiohttp's own
    decompression is off: a corrupt gzip body was a 500, brotli a plain-text 400), one
    that cannot be read (a broken chunked encoding), one that is not JSON."""
    if request.method != "POST" or request.match_info.http_exception is not None:
        return await handler(request)  # not a POST, or no such endpoint (404, 405)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequest(f"Content-Encoding {encoding[:40]!r} is not supported: send the body "
                         "uncompressed", code="unsupported_content_encoding", status=415)
    try:
        data = await request.read()
    except web.HTTPException:
        raise  # too large (413): openai_errors answers it
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # aiohttp's payload errors: a chunked body cut or malformed
        raise BadRequest(f"the request body could not be read ({type(e).__name__})") from None
    try:
        request[BODY] = json.loads(data)
    except RecursionError:
        raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as e:  # also bad UTF-8
        raise BadRequest(f"the request body is not valid JSON ({str(e)[:100]})") from None
    if nested_deeper_than(request[BODY], MAX_JSON_DEPTH):
        raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} deep")
    return await handler(request)


def nested_deeper_than(value, limit):
    """Whether a parsed JSON value has lists or objects nested more than limit deep (a
    loop, not recursion: the value may be ~1,000 deep)."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth > limit:
                return True
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return False


def shown(value):
    """A client's value in an error message: JSON, cut to a few dozen characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a number


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def number(body, name, default, low, high, integer=False, low_open=False):
    """body[name] (null: the default) checked to be a number in [low, high] ((low, high]
    with low_open); one BadRequest naming the field otherwise."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if not (is_int(value) if integer else is_number(value)):
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


def stop_strings(body):
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(stop) > MAX_STOPS:
        raise BadRequest(f"'stop' takes at most {MAX_STOPS} strings, got {len(stop)}", "stop", "invalid_value")
    return tuple(stop)


def logprobs_count(body, name):
    """How many top log-probabilities a request asks for: null (none) or 0..MAX_LOGPROBS."""
    return number(body, name, None, 0, MAX_LOGPROBS, integer=True)


def stop_token_ids(body, tokenizer):
    """The vLLM extra 'stop_token_ids': token ids that end the text."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not (isinstance(ids, list) and all(map(is_int, ids))):
        raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t < tokenizer.n_vocab for t in ids):
        raise BadRequest(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids in "
                         f"[0, {tokenizer.n_vocab})", "stop_token_ids", "invalid_value")
    return tuple(ids)


def check_model(body, model_name):
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise BadRequest(f"The model {shown(model)} does not exist; this server serves '{model_name}'",
                         "model", "model_not_found")


def refuse_unsupported(body, unsupported):
    for name, unused in unsupported.items():
        if body.get(name, unused) not in (unused, None):
            raise BadRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def sampling_fields(body, tokenizer):
    """(SamplingParams fields every endpoint shares, n, seed, stream, include_usage)."""
    top_k = number(body, "top_k", None, -1, 10**9, integer=True)
    if top_k == 0:
        raise BadRequest("'top_k' must be -1 (off) or >= 1, got 0", "top_k", "invalid_value")
    top_p = number(body, "top_p", 1.0, 0, 1, low_open=True)
    seed = number(body, "seed", None, -2**63, 2**63 - 1, integer=True)
    fields = dict(temperature=number(body, "temperature", 1.0, 0, 2),
                  top_k=None if top_k in (None, -1) else top_k,
                  top_p=None if top_p == 1 else top_p,
                  stop=stop_strings(body), stop_token_ids=stop_token_ids(body, tokenizer),
                  stop_at_eot=not flag(body, "ignore_eos"))
    n = number(body, "n", 1, 1, MAX_N, integer=True)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    return fields, n, seed, flag(body, "stream"), flag(options, "include_usage")


def check_room(prompt_len, max_tokens, context, param, policy):
    """Refuse a prompt plus max_tokens past the context, as OpenAI and vLLM do; with the
    policy "reprefill" the engine keeps going past it instead."""
    if policy == "error" and prompt_len + max_tokens > context:
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, you "
                         f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                         f"{param}, {max_tokens} in the completion). Please reduce the length of "
                         f"the {param} or completion (or start serve.py with --context-policy "
                         "reprefill to keep going past the context).", param, "context_length_exceeded")


@dataclass
class Parsed:
    """What a completion or chat request asks for."""
    prompts: list        # token ids of each prompt
    samples: list        # SamplingParams of each of the n samples of a prompt
    stream: bool
    include_usage: bool
    logprobs: bool       # the choices carry logprobs
    echo: bool = False   # (completions) the text starts with the prompt


def prompt_list(body):
    """The prompts of the request, each a string or a list of token ids: 'prompt' is a
    string, a list of strings, a list of token ids, or a list of such lists (OpenAI's four
    forms)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(is_int, prompt))):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(map(is_int, p))) for p in prompt)):
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


def check_size(limits, num_prompts, n, max_tokens):
    """The request's size against the admission limits (admission.py), before any work:
    encoding, sampling state. The engine checks again when the work is submitted."""
    limits.check_sequences(num_prompts, n)
    limits.check_new_tokens(num_prompts * n * max_tokens, num_prompts * n)


def samples_of(fields, n, seed):
    """The SamplingParams of n samples: sample i of n draws from seed + i, so the n texts
    differ and each is reproducible."""
    return [SamplingParams(**fields, seed=None if seed is None else seed + i) for i in range(n)]


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
    fields, n, seed, stream, include_usage = sampling_fields(body, tokenizer)
    check_size(limits, len(prompts), n, max_tokens)
    prompts = prompt_ids(prompts, tokenizer, context, limits)
    for p in prompts:
        check_room(len(p), max_tokens, context, "prompt", policy)
    fields.update(max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=logprobs if echo and logprobs is not None else None)
    return Parsed(prompts, samples_of(fields, n, seed), stream, include_usage,
                  logprobs is not None, echo)


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


def parse_chat(body, tokenizer, context, model_name, template, limits, policy="error"):
    """A Parsed /v1/chat/completions request. Generation stops at the template's
    end-of-turn tokens (with the end-of-text, and ignored with it by ignore_eos, as vLLM
    treats a model's end-of-sequence ids)."""
    check_model(body, model_name)
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    fields, n, seed, stream, include_usage = sampling_fields(body, tokenizer)
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
    check_room(len(prompt), max_tokens, context, "messages", policy)
    check_size(limits, 1, n, max_tokens)
    logprobs, top = flag(body, "logprobs"), logprobs_count(body, "top_logprobs")
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if fields["stop_at_eot"]:
        fields["stop_token_ids"] += template.end_of_turn_ids
    fields.update(max_tokens=max_tokens, logprobs=(top or 0) if logprobs else None)
    return Parsed([prompt], samples_of(fields, n, seed), stream, include_usage, logprobs)


def tokenize_request(body, tokenizer, context, model_name, template):
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


# ---------------------------------------------------------------------------- the routes

class HandOut:
    """Outputs from the engine's thread to the requests' asyncio queues, one wake-up of the
    event loop for as many as are ready. call_soon_threadsafe writes to the loop's wake-up
    pipe (a system call) and queues a callback, on every call; a step of 64 streams made 64
    of each. Here the first Output since the last hand-out asks for one, and the rest join
    it in the deque."""

    def __init__(self):
        self.pending, self.scheduled = deque(), False

    def put(self, loop, queue, item):  # the engine's thread
        self.pending.append((queue, item))
        if not self.scheduled:  # read after the append: a drain that has begun will see it
            self.scheduled = True
            try:
                loop.call_soon_threadsafe(self.drain)
            except RuntimeError:
                pass  # the event loop has closed: the server is shutting down

    def drain(self):  # the event loop's thread
        self.scheduled = False  # before emptying: what comes later asks for another drain
        while self.pending:
            queue, item = self.pending.popleft()
            queue.put_nowait(item)


class CompletionServer:
    def __init__(self, engine, tokenizer, model_name, chat_template=None, api_key=None,
                 context_policy="error"):
        """chat_template: a chat.ChatTemplate (None: chat requests get a 400 saying how to
        give one); api_key: required of every request but /health (None: open);
        context_policy: "error" (refuse prompt + max_tokens past the context) or
        "reprefill" (accept it, keep going past the context)."""
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {CONTEXT_POLICIES}, got {context_policy!r}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template, self.api_key, self.context_policy = chat_template, api_key, context_policy
        self.context = engine.model.config.context_len
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self.hand_out = HandOut()
        # the configuration that decides what the model writes: same fingerprint, same weights
        # and settings (OpenAI's system_fingerprint; here a hash, not a build identifier)
        weights = engine.model.lm_head.weight
        config = f"{model_name} {engine.model.config} {weights.dtype} {tuple(weights.shape)}"
        self.fingerprint = "fp_" + hashlib.blake2b(config.encode(), digest_size=5).hexdigest()

    def app(self):
        checks = [api_key_check(self.api_key)] if self.api_key else []
        # the key is checked before the body is read: a stranger's body is not even parsed
        app = web.Application(middlewares=[openai_errors, *checks, read_body])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request):
        return web.json_response({"status": "ok", **self.engine.stats()})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "kvcache-gpt", "max_model_len": self.context}]})

    async def completions(self, request):
        # parsed (and its text encoded) on a worker thread: a long prompt must not hold up
        # /health and every other client
        parsed = await asyncio.to_thread(parse_completion, request[BODY], self.tokenizer, self.context,
                                         self.model_name, self.engine.limits, self.context_policy)
        return await self.answer(request, parsed, lambda *a: CompletionReply(
            *a, echo=parsed.echo, logprobs=parsed.logprobs))

    async def chat_completions(self, request):
        parsed = await asyncio.to_thread(parse_chat, request[BODY], self.tokenizer, self.context,
                                         self.model_name, self.chat_template, self.engine.limits,
                                         self.context_policy)
        return await self.answer(request, parsed, lambda *a: ChatReply(*a, logprobs=parsed.logprobs))

    async def answer(self, request, parsed, make_reply):
        """Queue every choice on the engine and answer with make_reply(server, choices,
        outputs, prompt lengths, n): whole, or streamed."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def on_output(engine_request, output):  # the engine's thread
            self.metrics.output(engine_request, output)
            self.hand_out.put(loop, outputs, (engine_request, output))

        # choice index = prompt index * n + sample index, as OpenAI numbers them (submit's
        # order); all or nothing, past the admission limits nothing (RequestTooLarge, Overloaded)
        choices = self.engine.submit(parsed.prompts, parsed.samples, on_output)
        self.metrics.received(sum(map(len, parsed.prompts)))
        reply = make_reply(self, choices, outputs, [len(p) for p in parsed.prompts], len(parsed.samples))
        try:
            if parsed.stream:
                return await reply.stream(request, parsed.include_usage)
            return await reply.whole()
        finally:  # done, failed, or the client went away: nothing of this request runs on
            for r in choices:
                if id(r) not in reply.finished:
                    self.engine.cancel(r)

    async def tokenize(self, request):
        ids = await asyncio.to_thread(tokenize_request, request[BODY], self.tokenizer, self.context,
                                      self.model_name, self.chat_template)
        return web.json_response({"count": len(ids), "max_model_len": self.context, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, request):
        body = request[BODY]
        check_model(body, self.model_name)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(map(is_int, ids))):
            raise BadRequest("'tokens' must be a list of token ids", "tokens", "invalid_type")
        if not all(0 <= t < self.tokenizer.n_vocab for t in ids):
            raise BadRequest(f"token ids must be in [0, {self.tokenizer.n_vocab})", "tokens", "invalid_value")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def metrics_page(self, request):
        return web.Response(body=self.metrics.page(),
                            headers={"Content-Type": self.metrics.content_type})


# ---------------------------------------------------------------------------- running it

class OneLineErrors(logging.Filter):
    """aiohttp logs a request that is not HTTP (a malformed line or header, which it answers
    with a plain 400 itself) with a traceback: one line per such request is enough."""

    def filter(self, record):
        if record.exc_info:
            error = record.exc_info[1]
            what = " ".join(str(getattr(error, "message", None) or error).split())[:120]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {what}"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


async def start(server, host, port):
    """Start the HTTP server (a CompletionServer); returns (runner, port bound). The
    engine runs elsewhere."""
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineErrors) for f in log.filters):
        log.addFilter(OneLineErrors())
    runner = web.AppRunner(server.app(),
                           handler_cancellation=True,  # a client that leaves cancels its handler
                           access_log=None,
                           auto_decompress=False,  # read_body refuses compressed bodies itself
                           shutdown_timeout=2.0)  # on close, what still runs gets 2 s, not 60
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


class BackgroundServer:
    """The HTTP server on its own event loop in its own thread, so that the thread that
    loaded the model is free to run the engine (Engine.run says why it should):

        with BackgroundServer(engine, tokenizer, "name") as url:   # url ends in /v1
            engine.run()                                            # until engine.stop()

    Keyword arguments go to CompletionServer (chat_template, api_key, context_policy).
    open() raises OSError when the address cannot be bound."""

    def __init__(self, engine, tokenizer, model_name, host="127.0.0.1", port=0, **server_args):
        self.server = CompletionServer(engine, tokenizer, model_name, **server_args)
        self.host, self.port = host, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)
        self.runner = None

    def open(self):
        self.thread.start()
        try:
            self.runner, port = asyncio.run_coroutine_threadsafe(
                start(self.server, self.host, self.port), self.loop).result()
        except BaseException:
            self.close()
            raise
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 in brackets
        return f"http://{host}:{port}/v1"

    def close(self):
        """Close every connection and end the thread. Handlers still waiting for the
        engine get 2 s, then are cancelled (their requests with them)."""
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
