"""
An OpenAI-compatible HTTP server on the engine (the command is serve.py):

    POST /v1/completions   prompt (a string, a list of strings, or token ids), max_tokens,
                           temperature, top_p, top_k (an extra, as in vLLM; -1 = off), n,
                           stop, seed, stream (server-sent events), stream_options,
                           ignore_eos (an extra: run to max_tokens)
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"} and the engine's counters (blocks free, ...)

The HTTP side (aiohttp, on an asyncio event loop in its own thread) and the engine
(serve.py runs it on the main thread) meet in two places: engine.add_request /
engine.cancel, and on_output, which the engine calls from its thread and which puts each
Output on the request's asyncio.Queue through loop.call_soon_threadsafe. A client that
goes away is noticed by aiohttp (the handler is cancelled, or its next write fails) and
its requests are cancelled at once: their blocks return to the pool at the engine's next
step.

Bad requests get HTTP 400 and OpenAI's error object:
    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
So does every body before any endpoint reads it (read_body: compressed, not JSON, nested
too deep: 400 or 415), and a request past the admission limits (admission.py: 400 naming
the limit, or 429 with Retry-After when the waiting queue is full).
"""

import asyncio
import json
import logging
import threading
import time
import traceback
import uuid

from aiohttp import web

from plumbing.user_text import TextError, encode_text, longest_token_bytes
from serving.admission import Overloaded, RequestTooLarge
from serving.engine import SamplingParams

MAX_N = 128          # samples per prompt
MAX_STOPS = 4        # as OpenAI
MAX_JSON_DEPTH = 64  # a real request nests 3 to 6 deep; 1,000 deep broke json.loads itself
BODY = web.RequestKey("body", object)  # request[BODY]: the parsed JSON body (read_body)
UNSUPPORTED = {      # fields we do not implement, and the value that means "not used"
    "logprobs": None, "echo": False, "best_of": 1, "suffix": None,
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
}


class EngineFailed(Exception):
    """A step of the engine failed while it ran this request (engine.abort_all)."""


class BadRequest(Exception):
    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_response(status, message, param=None, code=None, kind="invalid_request_error"):
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


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


def prompt_ids(prompts, tokenizer, context, limits):
    """The prompts as lists of token ids, each within the context and all together within
    the request's prompt tokens (limits), checked as they are encoded. An empty string
    starts from the end-of-text token, as generate.py does. A string with more characters
    than the context's tokens could ever hold is refused before it is encoded."""
    longest = longest_token_bytes(tokenizer)  # a character is at least one byte
    ids, total = [], 0
    for p in prompts:
        if isinstance(p, str):
            if longest is not None and len(p) > context * longest:
                raise BadRequest(f"This model's maximum context length is {context} tokens; the "
                                 f"prompt has more", "prompt", "context_length_exceeded")
            try:
                p = encode_text(tokenizer, p) or [tokenizer.eot_token]
            except TextError as e:
                raise BadRequest(f"'prompt': {e}", "prompt", "invalid_value") from None
        elif not all(0 <= t < tokenizer.n_vocab for t in p):
            raise BadRequest(f"token ids must be in [0, {tokenizer.n_vocab})", "prompt", "invalid_value")
        if len(p) > context:
            raise BadRequest(f"This model's maximum context length is {context} tokens; "
                             f"the prompt has {len(p)}", "prompt", "context_length_exceeded")
        total += len(p)
        limits.check_prompt_tokens(total)
        ids.append(p)
    return ids


def parse_completion(body, tokenizer, context, model_name, limits):
    """(prompts as token ids, [SamplingParams for each of the n samples], stream,
    include_usage). The request's size is held to the admission limits (admission.py)
    before its prompts are encoded."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise BadRequest(f"The model {shown(model)} does not exist; this server serves '{model_name}'",
                         "model", "model_not_found")
    for name, unused in UNSUPPORTED.items():
        if body.get(name, unused) not in (unused, None):
            raise BadRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    prompts = prompt_list(body)
    top_k = number(body, "top_k", None, -1, 10**9, integer=True)
    if top_k == 0:
        raise BadRequest("'top_k' must be -1 (off) or >= 1, got 0", "top_k", "invalid_value")
    top_p = number(body, "top_p", 1.0, 0, 1, low_open=True)
    seed = number(body, "seed", None, -2**63, 2**63 - 1, integer=True)
    base = dict(max_tokens=number(body, "max_tokens", 16, 1, 10**6, integer=True),
                temperature=number(body, "temperature", 1.0, 0, 2),
                top_k=None if top_k in (None, -1) else top_k,
                top_p=None if top_p == 1 else top_p,
                stop=stop_strings(body), stop_at_eot=not flag(body, "ignore_eos"))
    n = number(body, "n", 1, 1, MAX_N, integer=True)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    sequences = len(prompts) * n
    limits.check_sequences(len(prompts), n)  # before any work: encoding, sampling state
    limits.check_new_tokens(sequences * base["max_tokens"], sequences)
    # sample i of n draws from seed + i: n different texts, each reproducible
    samples = [SamplingParams(**base, seed=None if seed is None else seed + i) for i in range(n)]
    prompts = prompt_ids(prompts, tokenizer, context, limits)
    return prompts, samples, flag(body, "stream"), flag(options, "include_usage")


# ---------------------------------------------------------------------------- the routes

class CompletionServer:
    def __init__(self, engine, tokenizer, model_name):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context = engine.model.config.context_len
        self.created = int(time.time())

    def app(self):
        app = web.Application(middlewares=[openai_errors, read_body])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request):
        return web.json_response({"status": "ok", **self.engine.stats()})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "kvcache-gpt", "max_model_len": self.context}]})

    async def completions(self, request):
        # encoded on a worker thread (tiktoken lets go of the interpreter lock): a long
        # prompt must not hold up /health and every other client
        prompts, samples, stream, include_usage = await asyncio.to_thread(
            parse_completion, request[BODY], self.tokenizer, self.context, self.model_name,
            self.engine.limits)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def on_output(engine_request, output):  # the engine's thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, (engine_request, output))
            except RuntimeError:
                pass  # the event loop has closed: the server is shutting down

        # choice index = prompt index * n + sample index, as OpenAI numbers them (submit's
        # order); all or nothing, past the admission limits nothing (RequestTooLarge, Overloaded)
        choices = self.engine.submit(prompts, samples, on_output)
        index = {id(r): i for i, r in enumerate(choices)}
        reply = Reply(self, choices, index, outputs, sum(map(len, prompts)))
        try:
            if stream:
                return await reply.stream(request, include_usage)
            return await reply.whole()
        finally:  # done, failed, or the client went away: nothing of this request runs on
            for r in choices:
                if id(r) not in reply.finished:
                    self.engine.cancel(r)


class Reply:
    """The choices of one completion request, read from the engine as they come."""

    def __init__(self, server, choices, index, outputs, prompt_tokens):
        self.server, self.choices, self.index, self.outputs = server, choices, index, outputs
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [""] * len(choices)
        self.reasons = [None] * len(choices)
        self.finished = set()
        self.prompt_tokens = prompt_tokens  # once per prompt, however many samples

    async def next(self):
        """(choice index, Output) of the next output; EngineFailed when a step failed."""
        request, output = await self.outputs.get()
        if output.finish_reason is not None:
            self.finished.add(id(request))
        if output.finish_reason == "error":
            raise EngineFailed(f"the engine failed: {request.error}")
        i = self.index[id(request)]
        self.texts[i] += output.text
        self.reasons[i] = output.finish_reason
        return i, output

    def body(self, choices, usage=False):
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.server.model_name, "choices": choices}
        if usage:
            completion = sum(r.num_generated for r in self.choices)
            body["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                             "total_tokens": self.prompt_tokens + completion}
        return body

    async def whole(self):
        while len(self.finished) < len(self.choices):
            await self.next()
        return web.json_response(self.body([
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(zip(self.texts, self.reasons))], usage=True))

    async def stream(self, request, include_usage):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data):
            await response.write(f"data: {json.dumps(data)}\n\n".encode())
        while len(self.finished) < len(self.choices):
            try:
                i, output = await self.next()
            except EngineFailed as e:  # headers are sent: the error goes in the stream
                await send({"error": {"message": str(e), "type": "server_error",
                                      "param": None, "code": None}})
                break
            if output.text or output.finish_reason:
                await send(self.body([{"index": i, "text": output.text, "logprobs": None,
                                       "finish_reason": output.finish_reason}]))
        else:
            if include_usage:
                await send(self.body([], usage=True))
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


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


async def start(engine, tokenizer, model_name, host, port):
    """Start the HTTP server; returns (runner, port bound). The engine runs elsewhere."""
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineErrors) for f in log.filters):
        log.addFilter(OneLineErrors())
    runner = web.AppRunner(CompletionServer(engine, tokenizer, model_name).app(),
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

    open() raises OSError when the address cannot be bound."""

    def __init__(self, engine, tokenizer, model_name, host="127.0.0.1", port=0):
        self.args = (engine, tokenizer, model_name, host, port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)
        self.runner = None

    def open(self):
        self.thread.start()
        try:
            self.runner, port = asyncio.run_coroutine_threadsafe(
                start(*self.args), self.loop).result()
        except BaseException:
            self.close()
            raise
        host = self.args[3]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"  # IPv6 in brackets

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
