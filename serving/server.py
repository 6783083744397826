"""
An OpenAI-compatible HTTP server on the engine (the command is serve.py):

    POST /v1/completions   prompt (a string, a list of strings, or token ids), max_tokens
                           (0 with echo: score the prompt only), the sampling fields
                           (temperature, top_p, top_k, min_p, the penalties, logit_bias,
                           ...), stop, seed, n, stream, logprobs (0-20), echo, and a
                           structured-output constraint (response_format, vLLM's
                           structured_outputs / guided_*)
    POST /v1/chat/completions  messages, rendered with the model's chat template
                           (chat.py), the same fields, logprobs / top_logprobs, tools and
                           tool_choice (calls read back by tool_calls.py)
    POST /tokenize, /detokenize   text <-> token ids (vLLM's extras)
    GET  /v1/models        the one model served, with max_model_len
    GET  /metrics          Prometheus's text format (metrics.py)
    GET  /health           {"status": "ok"} and the engine's counters (blocks free, ...)
    GET  /v1/cache         the paged pool's blocks: free, cached, held by each request,
                           shared (cache_view.py)
    GET  /                 the web page (serving/web/): chat with the model, watch the cache

With an API key (serve.py --api-key), every path but /health and the page's own files
wants the header `Authorization: Bearer KEY` and answers 401 without it (the page asks
for the key and sends it). A prompt plus max_tokens longer
than the model's context is refused (400, naming both), as OpenAI and vLLM do, unless the
server keeps going past the context (context_policy "reprefill", the generation loop's
policy). Each endpoint's body is a model of request_schema.py (every field it takes, an
unknown one refused), read in request_parsing.py; the answers are shaped in replies.py;
this file is the HTTP side: routes, streaming, the API key, and the server's own thread
(BackgroundServer).

The HTTP side (aiohttp, on an asyncio event loop in its own thread) and the engine
(serve.py runs it on the main thread) meet in three places: engine.submit /
engine.cancel; on_output, which the engine calls from its thread and which puts each
Output for the request's asyncio.Queue in HandOut; and engine.after_hand_out, called once a
pass's Outputs are all put, when HandOut wakes the loop once for them all and waits for it
to send them (the interpreter lock: HandOut says why). A client that
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
import weakref
from collections import deque
from pathlib import Path

from aiohttp import web

from serving.admission import SERVING_CONTEXT_POLICIES, Overloaded, RequestTooLarge
from serving.cache_view import cache_view, pool_formula
from serving.metrics import ServerMetrics
from serving.replies import ChatReply, CompletionReply, EngineFailed, token_text
from serving.request_parsing import (BadRequest, parse_chat, parse_completion, parse_detokenize,
                                     parse_tokenize)

MAX_JSON_DEPTH = 64  # a real request nests 3 to 6 deep; 1,000 deep broke json.loads itself
BODY = web.RequestKey("body", object)  # request[BODY]: the parsed JSON body (read_body)
# the web page's files, by path: (file in serving/web/, content type); loaded without the
# key (they hold no data: what the page shows, it fetches with the key)
PAGE_FILES = {"/": ("index.html", "text/html"), "/web/page.css": ("page.css", "text/css"),
              "/web/icon.svg": ("icon.svg", "image/svg+xml"),
              **{f"/web/{name}": (name, "text/javascript")
                 for name in ("page.js", "api.js", "controls.js", "tokens.js", "cache.js")}}
OPEN_PATHS = ("/health", *PAGE_FILES)  # answered without the API key
# The page's files run no script but their own: no inline script or style for a prompt's
# text to smuggle one into, no other origin to load from or send to
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                "frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


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


# ---------------------------------------------------------------------------- reading the body

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


# ---------------------------------------------------------------------------- the routes

class HandOut:
    """Outputs from the engine's thread to the requests' asyncio queues, a pass's at a time,
    and the engine waits while the event loop sends them.

    Together, because call_soon_threadsafe writes to the loop's wake-up pipe (a system call)
    and queues a callback on every call: one per output would be 64 of each per step of 64
    streams. The wait, because the two threads share the interpreter lock and the compiled
    step holds it through each of its C++ kernels (inductor calls them with the lock held;
    only aten's operators, the matmuls, let it go): a loop writing 64 streams while a step
    runs takes the lock from the engine for up to the switch interval (5 ms) at a time, and
    the step of 64 streams on the bundled model goes from 8.7 ms to 12-15 (docs/serving.md,
    "Why the engine waits for the sends"). Sending first, then stepping with the lock to
    itself, costs ~2 ms a step. The wait is bounded (SEND_WAIT_S): a loop that is busy
    elsewhere delays a step by that much at most."""
    SEND_WAIT_S = 0.02
    # One output alone (one stream) is sent while the next step runs: waiting for it cost
    # more (two thread wake-ups) than sharing the lock did, a lone stream's tokens/s
    # ~0.8x; from two streams on, the wait paid (docs/serving.md)
    WAIT_FROM = 2

    def __init__(self):
        self.pending, self.loop = deque(), None
        self.sent = threading.Event()

    def put(self, loop, queue, item):  # the engine's thread, during a pass
        self.loop = loop  # the server's one loop
        self.pending.append((queue, item))

    def flush(self):  # the engine's thread, once a pass's outputs are all put
        if not self.pending:
            return
        wait = len(self.pending) >= self.WAIT_FROM
        # a drain left over from a wait that timed out may set it early: a shorter wait, no harm
        self.sent.clear()
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the event loop has closed: the server has stopped
            self.pending.clear()
            return
        if wait:
            self.sent.wait(self.SEND_WAIT_S)

    def drain(self):  # the event loop's thread
        while self.pending:
            queue, item = self.pending.popleft()
            queue.put_nowait(item)  # wakes the stream waiting on it: soon, in this order
        # after the streams' wake-ups in the loop's queue: runs once each has sent
        self.loop.call_soon(self.sent.set)


class CompletionServer:
    def __init__(self, engine, tokenizer, model_name, chat_template=None, api_key=None,
                 context_policy="error"):
        """chat_template: a chat.ChatTemplate (None: chat requests get a 400 saying how to
        give one); api_key: required of every request but /health (None: open);
        context_policy: "error" (refuse prompt + max_tokens past the context) or
        "reprefill" (accept it, keep going past the context)."""
        if context_policy not in SERVING_CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {SERVING_CONTEXT_POLICIES}, "
                             f"got {context_policy!r}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template, self.api_key, self.context_policy = chat_template, api_key, context_policy
        self.context = engine.model.config.context_len
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self.hand_out = HandOut()
        engine.after_hand_out.append(self.hand_out.flush)
        # engine request -> (its reply's id, choice index), for /v1/cache; an entry goes
        # with its request
        self.reply_ids = weakref.WeakKeyDictionary()
        self.formula = pool_formula(engine.model, engine.pool)
        template = None if chat_template is None else {
            "origin": Path(chat_template.origin).name,  # a file's name, not where it lives
            "end_of_turn": [tokenizer.decode([t]) for t in chat_template.end_of_turn_ids]}
        self.model_info = {"name": model_name, "context_len": self.context, "chat_template": template}
        folder = Path(__file__).parent / "web"
        self.page = {path: ((folder / name).read_bytes(), kind) for path, (name, kind) in PAGE_FILES.items()}
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
        app.router.add_get("/v1/cache", self.cache)
        for path in PAGE_FILES:
            app.router.add_get(path, self.page_file)
        return app

    async def health(self, request):
        return web.json_response({"status": "ok", **self.engine.stats()})

    async def cache(self, request):
        return web.json_response(cache_view(self.engine, self.reply_ids.get, self.formula,
                                            self.model_info))

    async def page_file(self, request):
        body, kind = self.page[request.path]
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=PAGE_HEADERS)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "kvcache-gpt", "max_model_len": self.context}]})

    async def completions(self, request):
        parsed, processors = await self.parse_off_the_loop(
            parse_completion, request[BODY], self.tokenizer, self.context, self.model_name,
            self.engine.limits, self.context_policy)
        return await self.answer(request, parsed, processors, lambda *a: CompletionReply(
            *a, echo=parsed.echo, logprobs=parsed.logprobs))

    async def chat_completions(self, request):
        parsed, processors = await self.parse_off_the_loop(
            parse_chat, request[BODY], self.tokenizer, self.context, self.model_name,
            self.chat_template, self.engine.limits, self.context_policy)
        return await self.answer(request, parsed, processors, lambda *a: ChatReply(
            *a, logprobs=parsed.logprobs, tools=parsed.tools))

    async def parse_off_the_loop(self, parse, *args):
        """parse(*args) and each sample's logits processors, on a worker thread: encoding a
        long prompt, rendering a template or compiling a grammar (up to seconds) must not
        hold up /health and every other client. A constraint that does not compile is a 400."""
        def work():
            parsed = parse(*args)
            try:
                return parsed, [params.processors(self.tokenizer, self.tokenizer.n_vocab)
                                for params in parsed.samples]
            except ValueError as e:
                raise BadRequest(str(e), code="invalid_value") from None
        return await asyncio.to_thread(work)

    async def answer(self, request, parsed, processors, make_reply):
        """Queue every choice on the engine and answer with make_reply(server, choices,
        outputs, prompt lengths, n): whole, or streamed."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def on_output(engine_request, output):  # the engine's thread
            self.metrics.output(engine_request, output)
            self.hand_out.put(loop, outputs, (engine_request, output))

        # choice index = prompt index * n + sample index, as OpenAI numbers them (submit's
        # order); all or nothing, past the admission limits nothing (RequestTooLarge, Overloaded)
        try:
            choices = self.engine.submit(parsed.prompts, parsed.samples, on_output, processors)
        except RequestTooLarge:
            raise  # openai_errors answers it, naming the limit
        except ValueError as e:  # a setting the engine refuses (request_parsing checks first)
            raise BadRequest(str(e), code="invalid_value") from None
        self.metrics.received(sum(map(len, parsed.prompts)))
        reply = make_reply(self, choices, outputs, [len(p) for p in parsed.prompts], len(parsed.samples))
        for i, r in enumerate(choices):
            self.reply_ids[r] = (reply.id, i)
        try:
            if parsed.stream:
                return await reply.stream(request, parsed.include_usage, parsed.continuous_usage)
            return await reply.whole()
        finally:  # done, failed, or the client went away: nothing of this request runs on
            for r in choices:
                if id(r) not in reply.finished:
                    self.engine.cancel(r)

    async def tokenize(self, request):
        def tokens_and_texts():  # on a worker thread, as a completion's prompt is encoded
            ids, with_texts = parse_tokenize(request[BODY], self.tokenizer, self.context,
                                             self.model_name, self.chat_template)
            # token_strs (vLLM's return_token_strs): each token's bytes decoded alone, as in logprobs
            return ids, [token_text(self.tokenizer, t) for t in ids] if with_texts else None
        ids, strs = await asyncio.to_thread(tokens_and_texts)
        return web.json_response({"count": len(ids), "max_model_len": self.context, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request):
        ids = parse_detokenize(request[BODY], self.tokenizer, self.model_name)
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
