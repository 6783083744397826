"""
Replies: the engine's outputs for one HTTP request, in OpenAI's shapes (request_parsing.py
reads the request, server.py starts the engine's work; this file answers it).

One request is several engine requests, its choices (prompts x n). Their outputs arrive
on an asyncio.Queue, in any order; a Reply gathers them and answers either at the end
(one JSON body) or as they come (server-sent events, a chunk per piece of text):

    CompletionReply   /v1/completions        choices[].text, logprobs as tokens /
                                             token_logprobs / top_logprobs / text_offset
    ChatReply         /v1/chat/completions   choices[].message (delta when streamed),
                                             logprobs as content[] with top_logprobs,
                                             tool_calls read out of the text (tool_calls.py)

Log-probabilities are the model's raw ones (before temperature, top-k and top-p, as vLLM
reports them by default). A token's text in them is its bytes decoded on their own, so a
token holding half a UTF-8 character reads as U+FFFD; chat logprobs carry the bytes too.
"""

import json
import time
import uuid

from aiohttp import web


class EngineFailed(Exception):
    """A step of the engine failed while it ran this request (engine.abort_all)."""


def token_text(tokenizer, token):
    return tokenizer.decode_single_token_bytes(token).decode("utf-8", errors="replace")


class Reply:
    """The choices of one request, read from the engine as they come. Subclasses give the
    shapes: whole_choice(i) for the one-body answer, chunk_choice(i, output) for a
    streamed one (None: nothing to send for this output)."""
    id_prefix = object_name = chunk_object = None

    def __init__(self, server, choices, outputs, prompt_lens, n):
        """choices: the engine requests, prompt-major (choice i is prompt i // n); outputs:
        the queue on_output fills; prompt_lens: each prompt's tokens."""
        self.server, self.choices, self.outputs, self.n = server, choices, outputs, n
        self.index = {id(r): i for i, r in enumerate(choices)}
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_lens = prompt_lens
        self.texts = [""] * len(choices)
        self.reasons = [None] * len(choices)
        self.logprobs = [[] for _ in choices]  # Logprob of each new token, when asked for
        self.finished = set()

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
        if output.logprob is not None:
            self.logprobs[i].append(output.logprob)
        return i, output

    def usage(self):
        """Tokens in (once per prompt, however many samples) and out; cached_tokens: the
        prompt tokens the prefix cache spared (the least of a prompt's samples: the first
        one admitted may have computed what the others then found)."""
        prompt = sum(self.prompt_lens)
        completion = sum(r.num_generated for r in self.choices)
        cached = sum(min(r.cached_prompt_tokens or 0 for r in self.choices[p * self.n:(p + 1) * self.n])
                     for p in range(len(self.prompt_lens)))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def body(self, choices, chunk=False, usage=False):
        body = {"id": self.id, "object": self.chunk_object if chunk else self.object_name,
                "created": self.created, "model": self.server.model_name,
                "system_fingerprint": self.server.fingerprint, "choices": choices}
        if usage:
            body["usage"] = self.usage()
        return body

    async def whole(self):
        while len(self.finished) < len(self.choices):
            await self.next()
        return web.json_response(self.body([self.whole_choice(i) for i in range(len(self.choices))],
                                           usage=True))

    async def stream(self, request, include_usage, continuous_usage=False):
        """Server-sent events: a chunk per piece, then (with include_usage, which also puts
        "usage": null on every chunk, as OpenAI does) one with the usage, then [DONE]. With
        continuous_usage (vLLM's continuous_usage_stats) every chunk has the usage so far."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(events, done=False):
            data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
            await response.write(data + (b"data: [DONE]\n\n" if done else b""))

        def chunk(choices):
            body = self.body(choices, chunk=True, usage=continuous_usage)
            return {**body, "usage": None} if include_usage and not continuous_usage else body
        opening = [chunk([first]) for first in self.opening_choices()]
        if opening:
            await send(opening)
        # Events that are ready go out together, in one write: when the engine runs ahead of
        # this loop (many streams, or n choices, each getting a token every step), outputs
        # queue up, and one write for all of them costs one network send, not one each.
        # When the queue is empty what is ready goes out at once: nothing waits.
        events = []
        while len(self.finished) < len(self.choices):
            try:
                i, output = await self.next()
            except EngineFailed as e:  # headers are sent: the error goes in the stream, then
                # [DONE], so that a client reading to the end sees a finished stream (vLLM's way)
                await send([*events, {"error": {"message": str(e), "type": "server_error",
                                                "param": None, "code": None}}], done=True)
                break
            choice = self.chunk_choice(i, output)
            if choice is not None:
                events.append(chunk([choice]))
            if events and self.outputs.empty():
                await send(events)
                events = []
        else:
            if include_usage:
                events.append(self.body([], chunk=True, usage=True))
            await send(events, done=True)
        await response.write_eof()
        return response

    def opening_choices(self):
        return []


class CompletionReply(Reply):
    """/v1/completions. With echo, a choice's text (and its logprobs) starts with its
    prompt: the prompt's tokens, the first with no log-probability (nothing predicts it)."""
    id_prefix, object_name, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, server, choices, outputs, prompt_lens, n, echo, logprobs):
        super().__init__(server, choices, outputs, prompt_lens, n)
        self.echo, self.want_logprobs = echo, logprobs
        self.offsets = [0] * len(choices)  # text_offset of the next token, per choice
        self.started = [False] * len(choices)

    def prompt_part(self, i):
        """(the prompt's text, its (token, Logprob or None) entries) when echoing, else ("", [])."""
        if not self.echo:
            return "", []
        r = self.choices[i]
        prompt = r.tokens[:r.prompt_len]
        scored = r.prompt_logprobs or [None] * len(prompt)
        return self.server.tokenizer.decode(prompt), list(zip(prompt, scored))

    def logprobs_object(self, i, entries):
        """OpenAI's completions logprobs for entries [(token, Logprob or None)]; text_offset
        counts characters of the choice's text, continuing across a stream's chunks. Each
        top_logprobs holds the likeliest tokens and the chosen one, as vLLM's does (keyed by
        text, so two tokens that read the same, such as two halves of characters, share a
        key: chat's logprobs, a list with each token's bytes, keep them apart)."""
        tokenizer = self.server.tokenizer
        shape = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in entries:
            text = token_text(tokenizer, token)
            shape["tokens"].append(text)
            shape["text_offset"].append(self.offsets[i])
            self.offsets[i] += len(text)
            shape["token_logprobs"].append(None if lp is None else lp.logprob)
            top = None
            if lp is not None:  # likeliest first: where two tokens read the same, the likelier stays
                top = {}
                for t, v in lp.top + [(token, lp.logprob)]:
                    top.setdefault(token_text(tokenizer, t), v)
            shape["top_logprobs"].append(top)
        return shape

    def whole_choice(self, i):
        prompt_text, prompt_entries = self.prompt_part(i)
        logprobs = None
        if self.want_logprobs:
            logprobs = self.logprobs_object(i, prompt_entries + [(lp.token, lp) for lp in self.logprobs[i]])
        return {"index": i, "text": prompt_text + self.texts[i], "logprobs": logprobs,
                "finish_reason": self.reasons[i]}

    def chunk_choice(self, i, output):
        prompt_text, entries = self.prompt_part(i) if not self.started[i] else ("", [])
        self.started[i] = True
        if output.logprob is not None:
            entries = entries + [(output.token, output.logprob)]
        text = prompt_text + output.text
        if not (text or output.finish_reason or (self.want_logprobs and entries)):
            return None
        logprobs = self.logprobs_object(i, entries) if self.want_logprobs else None
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason}


class ChatReply(Reply):
    """/v1/chat/completions: the assistant's message; streamed, a first chunk per choice
    with its role, then the content in deltas. With tools (a tool_calls.ToolUse), each
    choice's text is read for calls: they go in message.tool_calls, finish_reason
    "tool_calls"; streamed, content goes out as soon as it cannot be part of a call, and
    the calls in the last chunk (delta.tool_calls, each with its index)."""
    id_prefix, object_name, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, server, choices, outputs, prompt_lens, n, logprobs, tools=None):
        super().__init__(server, choices, outputs, prompt_lens, n)
        self.want_logprobs, self.tools = logprobs, tools
        self.readers = [tools and tools.reader() for _ in choices]  # a ToolCallText each, or None

    def logprobs_object(self, logprobs):
        tokenizer = self.server.tokenizer

        def entry(token, logprob):
            raw = tokenizer.decode_single_token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
        return {"content": [{**entry(lp.token, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}

    def whole_choice(self, i):
        content, calls = self.texts[i], []
        if self.readers[i] is not None:
            content, calls = self.tools.calls_in(content)
        message = {"role": "assistant", "content": (content or None) if calls else content}
        if calls:
            message["tool_calls"] = calls
        return {"index": i, "message": message,
                "logprobs": self.logprobs_object(self.logprobs[i]) if self.want_logprobs else None,
                "finish_reason": "tool_calls" if calls else self.reasons[i]}

    def opening_choices(self):
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(self.choices))]

    def chunk_choice(self, i, output):
        logprobs = [output.logprob] if output.logprob is not None else []
        text, calls, reason = output.text, [], output.finish_reason
        reader = self.readers[i]
        if reader is not None:  # what cannot be part of a call now; the rest at the end
            text = reader.add(text)
            if reason is not None:
                rest, calls = reader.end()
                text += rest
        if not (text or reason or (self.want_logprobs and logprobs)):
            return None
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return {"index": i, "delta": delta,
                "logprobs": self.logprobs_object(logprobs) if self.want_logprobs else None,
                "finish_reason": "tool_calls" if calls else reason}
