"""
Reading a request: each endpoint's JSON body (already parsed by server.read_body) validated
against its model (request_schema.py: every field typed and bounded, an unknown one refused)
and turned into what the engine takes, one function per endpoint:

    parse_completion   /v1/completions       -> Parsed (prompts as token ids, SamplingParams)
    parse_chat         /v1/chat/completions  -> Parsed (the messages rendered by the template)
    parse_tokenize     /tokenize             -> token ids (and whether their texts are wanted)
    parse_detokenize   /detokenize           -> token ids

Anything wrong raises BadRequest, which the server answers with HTTP 400 (or the status it
names) and OpenAI's error object naming the field (param) and why (code). What the schema
cannot know is checked here: token ids against the vocabulary, text against the context,
the constraints a request may give only one of. A request's size is held to the admission
limits (admission.py) before its text is encoded; the engine checks again when the work is
submitted. The answers are shaped in replies.py.
"""

import json
from dataclasses import dataclass

from plumbing.user_text import TextError, as_prompt, check_text, encode_text, longest_token_bytes
from serving.chat import TemplateError
from serving.request_schema import (MAX_SPEC_CHARS, BadRequest, ChatRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest, shown, validate)
from serving.requests import SamplingParams
from serving.tool_calls import ToolUse


@dataclass
class Parsed:
    """What a completion or chat request asks for."""
    prompts: list        # token ids of each prompt
    samples: list        # SamplingParams of each of the n samples of a prompt
    stream: bool
    include_usage: bool
    logprobs: bool       # the choices carry logprobs
    echo: bool = False   # (completions) the text starts with the prompt
    continuous_usage: bool = False  # (streams) the usage so far on every chunk, as vLLM
    tools: ToolUse = None  # (chat) the tools offered, read back out of the replies


# ---------------------------------------------------------------------------- the endpoints

def parse_completion(body, tokenizer, context, model_name, limits, policy="error"):
    """A Parsed /v1/completions request. logprobs: k gives every new token's
    log-probability and the k likeliest; echo returns the prompt too (with logprobs, its
    tokens' log-probabilities); max_tokens 0 with echo scores the prompt only. The
    request's size is held to the admission limits before its prompts are encoded."""
    request = read(CompletionRequest, body, model_name)
    if request.prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    logprobs, echo = request.logprobs, bool(request.echo)
    max_tokens = given(request.max_tokens, 16)
    if max_tokens == 0 and not echo:
        raise BadRequest("'max_tokens' must be >= 1 (0 only with echo, to score the prompt)",
                         "max_tokens", "invalid_value")
    fields, n = sampling_fields(request, tokenizer, context, max_tokens)
    check_size(limits, len(request.prompt), n, max_tokens)
    prompts = prompt_ids(request.prompt, tokenizer, context, limits)
    for p in prompts:
        check_fits_context(len(p), max_tokens, context, "prompt", policy)
    fields.update(max_tokens=max_tokens, logprobs=logprobs, structured=constraint(request),
                  prompt_logprobs=logprobs if echo and logprobs is not None else None)
    return Parsed(prompts, samples_of(fields, n, request.seed), logprobs=logprobs is not None,
                  echo=echo, **stream_flags(request))


def parse_chat(body, tokenizer, context, model_name, template, limits, policy="error"):
    """A Parsed /v1/chat/completions request. Generation stops at the template's
    end-of-turn tokens (with the end-of-text, and ignored with it by ignore_eos, as vLLM
    treats a model's end-of-sequence ids)."""
    request = read(ChatRequest, body, model_name)
    if request.messages is None:
        raise BadRequest("'messages' is required", "messages", "missing_required_parameter")
    n = given(request.n, 1)
    limits.check_sequences(1, n)  # before the template renders and the text is encoded
    tools = tool_use(request)
    prompt = chat_prompt(request, template, tokenizer, context, tools)
    limits.check_prompt_tokens(len(prompt))
    if len(prompt) >= context and policy == "error":
        raise BadRequest(f"This model's maximum context length is {context} tokens. However, your "
                         f"messages resulted in {len(prompt)} tokens, which leaves no room for a "
                         "reply. Please reduce the length of the messages.", "messages",
                         "context_length_exceeded")
    if len(prompt) > context:
        raise BadRequest(f"This model's maximum context length is {context} tokens; the messages "
                         f"have {len(prompt)}", "messages", "context_length_exceeded")
    max_tokens = given(request.max_completion_tokens, request.max_tokens)
    if max_tokens is None:  # as vLLM: what the context has room for
        max_tokens = max(context - len(prompt), 1)
    check_fits_context(len(prompt), max_tokens, context, "messages", policy)
    check_size(limits, 1, n, max_tokens)
    fields, _ = sampling_fields(request, tokenizer, context, max_tokens)
    logprobs, top = bool(request.logprobs), request.top_logprobs
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if fields["stop_at_eot"]:
        fields["stop_token_ids"] += template.end_of_turn_ids
    fields.update(max_tokens=max_tokens, logprobs=(top or 0) if logprobs else None,
                  structured=constraint(request, tools))
    return Parsed([prompt], samples_of(fields, n, request.seed), logprobs=logprobs, tools=tools,
                  **stream_flags(request))


def parse_tokenize(body, tokenizer, context, model_name, template):
    """/tokenize, as vLLM's: {"prompt": text} or {"messages": [...]} (rendered by the chat
    template, which writes its own BOS). A prompt's ids begin with the tokenizer's BOS when
    its config adds one (as /v1/completions feeds it), unless "add_special_tokens" is false.
    Returns (ids, whether each token's text was asked for: "return_token_strs")."""
    request = read(TokenizeRequest, body, model_name)
    return prompt_to_tokenize(request, tokenizer, context, template), bool(request.return_token_strs)


def prompt_to_tokenize(request, tokenizer, context, template):
    if request.messages is not None:
        return chat_prompt(request, template, tokenizer, context)
    if request.prompt is None:
        raise BadRequest("'prompt' (a string) or 'messages' is required", "prompt", "invalid_type")
    ids = user_text_ids(request.prompt, tokenizer, context, "prompt")
    bos = getattr(tokenizer, "bos_token_id", None) if given(request.add_special_tokens, True) else None
    return ids if bos is None else [bos, *ids]


def parse_detokenize(body, tokenizer, model_name):
    """/detokenize, as vLLM's: {"tokens": [ids]}, each a token of the tokenizer."""
    return list(token_ids(read(DetokenizeRequest, body, model_name).tokens, tokenizer, "tokens"))


# ---------------------------------------------------------------------------- the fields

def read(model, body, model_name):
    """The body as a request of model (request_schema.py), for the model served: "model"
    absent or null is the one served, as vLLM takes it."""
    if isinstance(body, dict) and body.get("model") not in (None, model_name):
        raise BadRequest(f"The model {shown(body['model'])} does not exist; this server serves "
                         f"'{model_name}'", "model", "model_not_found")
    return validate(model, body)


def given(value, default):
    return default if value is None else value


def token_ids(ids, tokenizer, param):
    """A list of the client's token ids as a tuple, each a token of the tokenizer."""
    if not all(0 <= t < tokenizer.n_vocab for t in ids):
        raise BadRequest(f"'{param}' takes token ids in [0, {tokenizer.n_vocab})", param, "invalid_value")
    return tuple(ids)


def stop_strings(stop, tokenizer, context):
    """At most context x longest_token_bytes characters in all (the schema holds the count
    to MAX_STOPS): a stop string matches text the sample writes, and a context's worth of
    tokens is at most that many characters (a character is at least one byte), so a longer
    one could never match within a context (past it, with --context-policy reprefill, only
    text whose start the model no longer sees). Every sample builds a matching table for
    each string before its first token, on the server's time: without the bound four
    strings of 250,000 characters and n 64 held up every other client for seconds."""
    if stop is None:
        return ()
    longest = longest_token_bytes(tokenizer)
    total = sum(map(len, stop))
    if longest is not None and total > context * longest:
        raise BadRequest(f"'stop' strings have {total:,} characters in all; at most "
                         f"{context * longest:,} (the most text a context of {context} tokens can "
                         "hold) can ever match", "stop", "invalid_value")
    return tuple(stop)


def sampling_fields(request, tokenizer, context, max_tokens):
    """(SamplingParams fields every endpoint shares, n). top_k 0 and -1 are off (as vLLM
    and llama.cpp read them); logit_bias's keys become token ids."""
    if given(request.min_tokens, 0) > max_tokens:
        raise BadRequest(f"'min_tokens' ({request.min_tokens}) is more than max_tokens ({max_tokens})",
                         "min_tokens", "invalid_value")
    bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
    allowed = request.allowed_token_ids
    fields = dict(temperature=given(request.temperature, 1.0),
                  top_k=None if request.top_k in (None, 0, -1) else request.top_k,
                  top_p=None if request.top_p in (None, 1) else request.top_p,
                  min_p=given(request.min_p, 0.0),
                  repetition_penalty=given(request.repetition_penalty, 1.0),
                  presence_penalty=given(request.presence_penalty, 0.0),
                  frequency_penalty=given(request.frequency_penalty, 0.0),
                  logit_bias=tuple(zip(token_ids(sorted(bias), tokenizer, "logit_bias"),
                                       (bias[t] for t in sorted(bias)))),
                  min_tokens=given(request.min_tokens, 0),
                  bad_words=tuple(request.bad_words or ()),
                  allowed_token_ids=None if allowed is None else token_ids(allowed, tokenizer,
                                                                           "allowed_token_ids"),
                  stop=stop_strings(request.stop, tokenizer, context),
                  stop_token_ids=token_ids(request.stop_token_ids or [], tokenizer, "stop_token_ids"),
                  stop_at_eot=not request.ignore_eos,
                  include_stop_str_in_output=bool(request.include_stop_str_in_output))
    return fields, given(request.n, 1)


def stream_flags(request):
    """Parsed's stream, include_usage and continuous_usage of a request."""
    options = request.stream_options
    return dict(stream=bool(request.stream), include_usage=bool(options and options.include_usage),
                continuous_usage=bool(options and options.continuous_usage_stats))


CONSTRAINT_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"),
                     ("guided_choice", "choice"), ("guided_grammar", "grammar"))


def constraint(request, tools=None):
    """SamplingParams.structured: (kind, spec) from whichever field asks for one
    (response_format, structured_outputs, the guided_* names, a required or named tool),
    or None. Two constraints in one request are a 400: which would hold is not obvious."""
    found = []  # (param, (kind, spec))
    form = request.response_format
    if form is not None and form.type == "json_object":
        found.append(("response_format", ("json_object", None)))
    if form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.schema_ is None:
            raise BadRequest("'response_format' of type json_schema needs json_schema.schema (a "
                             "JSON schema)", "response_format", "invalid_value")
        found.append(("response_format", ("json", form.json_schema.schema_)))
    chosen = request.structured_outputs
    if chosen is not None:
        kinds = [(kind, value) for kind, value in (("json", chosen.json_), ("regex", chosen.regex),
                 ("choice", chosen.choice), ("grammar", chosen.grammar)) if value is not None]
        kinds += [("json_object", None)] if chosen.json_object else []
        if len(kinds) != 1:
            raise BadRequest("'structured_outputs' takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {len(kinds)}", "structured_outputs", "invalid_value")
        found.append(("structured_outputs", kinds[0]))
    found += [(name, (kind, getattr(request, name))) for name, kind in CONSTRAINT_FIELDS
              if getattr(request, name) is not None]
    schema = tools.schema() if tools is not None else None
    if schema is not None:
        found.append(("tool_choice", ("json", schema)))
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise BadRequest(f"'{first}' and '{second}' both constrain the output; give one",
                         second, "invalid_value")
    return found[0][1] if found else None


def samples_of(fields, n, seed):
    """The SamplingParams of n samples: sample i of n draws from seed + i, so the n texts
    differ and each is reproducible. A setting the sampler cannot take (a constraint the
    grammar engine cannot compile) is a 400 here, before any work is queued."""
    samples = [SamplingParams(**fields, seed=None if seed is None else seed + i) for i in range(n)]
    try:
        samples[0].check()
    except ValueError as e:
        raise BadRequest(str(e), None, "invalid_value") from None
    return samples


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

def tool_use(request):
    """The ToolUse of a chat request (None without tools): tool_choice defaults to "auto"
    with tools, as OpenAI's; a named tool must be one of them."""
    choice = request.tool_choice
    if request.tools is None:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools' to choose from", "tool_choice", "invalid_value")
        return None
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in request.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise BadRequest("'tools' names a function twice", "tools", "invalid_value")
    if choice is not None and not isinstance(choice, str):
        if choice.function.name not in names:
            raise BadRequest(f"'tool_choice' names {shown(choice.function.name)}, which is not one of "
                             f"the tools ({', '.join(names)})", "tool_choice", "invalid_value")
        choice = choice.function.name
    use = ToolUse(tools, given(choice, "auto"), given(request.parallel_tool_calls, True))
    if len(json.dumps(use.schema())) > MAX_SPEC_CHARS:  # each tool's is bounded, not their sum
        raise BadRequest(f"the tools' parameters make a schema of more than {MAX_SPEC_CHARS:,} "
                         "characters as JSON: offer fewer tools, or name one in tool_choice",
                         "tools", "invalid_value")
    return use


def template_message(message):
    """A message as chat templates read it (transformers' and vLLM's way): content as text
    (None only for an assistant's message that calls tools), tool calls' arguments as the
    object they spell (templates write them with tojson)."""
    m = message.model_dump(exclude_none=True)
    m["content"] = message.content
    for call in m.get("tool_calls", ()):
        arguments = call["function"]["arguments"]
        try:
            call["function"]["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the string the client sent
    return m


def continued(text, final):
    """The rendered conversation cut right after the final message's text, so that the
    model continues it (continue_final_message, as transformers cuts it): the template
    closes the turn after it, and that closing must go."""
    stripped, kept = final.strip(), final.lstrip()  # kept: with its trailing space
    at = text.rfind(stripped)
    if not stripped or at < 0:
        raise BadRequest("'continue_final_message': the template does not write the final "
                         "message's text as it is, so it cannot be continued", "continue_final_message",
                         "invalid_value")
    return text[:at + (len(kept) if text.startswith(kept, at) else len(stripped))]


def render_options(request):
    """(add_generation_prompt, continue_final_message) of a request: the first is true
    unless the second is asked for; both true is a 400 (a new turn cannot continue the last)."""
    continue_final = bool(getattr(request, "continue_final_message", None))
    add_generation_prompt = given(request.add_generation_prompt, not continue_final)
    if continue_final and add_generation_prompt:
        raise BadRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                         "continue_final_message", "invalid_value")
    if continue_final and request.messages[-1].role != "assistant":
        raise BadRequest("'continue_final_message' continues the last message, which must be the "
                         "assistant's", "continue_final_message", "invalid_value")
    return add_generation_prompt, continue_final


def chat_prompt(request, template, tokenizer, context, tools=None):
    """Token ids of the conversation, rendered by the model's chat template with the tools
    and chat_template_kwargs as variables (as transformers' apply_chat_template passes
    them). The rendered text passes the same checks as a prompt's (user_text_ids) before it
    is encoded."""
    if template is None:
        raise BadRequest("This model has no chat template, so /v1/chat/completions cannot "
                         "render messages: start serve.py with --chat-template FILE (a Jinja "
                         "template), or serve a --hf directory whose tokenizer_config.json has a "
                         "chat_template; /v1/completions works without one", "messages",
                         "chat_template_missing")
    add_generation_prompt, continue_final = render_options(request)
    messages = [template_message(m) for m in request.messages]
    variables = getattr(request, "chat_template_kwargs", None) or {}
    try:
        text = template.render(messages, add_generation_prompt,
                               tools=None if tools is None else tools.tools, **variables)
    except TemplateError as e:
        raise BadRequest(f"the chat template refused these messages: {e}", "messages",
                         "invalid_value") from None
    if continue_final:
        text = continued(text, messages[-1]["content"] or "")
    check_user_text(text, tokenizer, context, "messages")
    return template.encode(text)
