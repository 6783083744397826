"""
Chat: a conversation (OpenAI's `messages`) to the prompt a chat model was trained on.

A chat model reads its conversation as one text with markers around each turn, and every
family has its own markers: ChatML's `<|im_start|>user ... <|im_end|>`, Llama 3's
`<|start_header_id|>user<|end_header_id|> ... <|eot_id|>`. The model's files carry the
recipe as a Jinja template (tokenizer_config.json's `chat_template`, or a
chat_template.jinja beside it), so a server renders it instead of knowing the families:

    template = ChatTemplate(source, tokenizer)
    ids = template.encode(template.render(messages))   # ends with the assistant's header
    template.end_of_turn_ids                           # the tokens that close a turn: stop there

Templates are rendered as transformers renders them (a sandboxed Jinja environment,
trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII), so the
same messages give the same prompt as `tokenizer.apply_chat_template`. The rendered text
holds the markers as text; they are encoded as the special tokens they name.
"""

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from plumbing.text_stream import eos_token_ids

ROLES = ("system", "user", "assistant", "developer", "tool")
TEMPLATE_MAX_BYTES = 1 << 20  # real templates are a few KB


class TemplateError(ValueError):
    """A template that cannot be read or rendered (a message saying which and why)."""


def raise_exception(message):  # what templates call to refuse a conversation
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source, tokenizer, bos_token=None, eos_token=None, origin="the template"):
        """source: the Jinja text; bos_token / eos_token: the strings the template may
        insert (tokenizer_config.json's; by default eos_token is the text of the tokenizer's
        first end-of-sequence id, and bos_token that of its BOS, or eos_token's without one)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                        indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"{origin}: not a Jinja template ({e})") from None
        self.tokenizer, self.origin = tokenizer, origin
        end_of_text = tokenizer.decode([eos_token_ids(tokenizer)[0]])
        begin = getattr(tokenizer, "bos_token_id", None)  # a Llama tokenizer's (hf_tokenizer.py)
        begin = end_of_text if begin is None else tokenizer.decode([begin])
        self.bos_token = begin if bos_token is None else bos_token
        self.eos_token = end_of_text if eos_token is None else eos_token
        self.end_of_turn_ids = self.find_end_of_turn_ids()

    def render(self, messages, add_generation_prompt=True, **variables):
        """The conversation as the model reads it; with add_generation_prompt, followed by
        the header of the assistant's turn, for the model to write. variables: what else the
        template reads (tools=, a model's own such as Qwen3's enable_thinking), as
        transformers' apply_chat_template passes them."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token,
                                        **variables)
        except TemplateError:
            raise
        except Exception as e:  # a template is a program: any error is the template's
            raise TemplateError(f"{self.origin} failed on these messages "
                                f"({type(e).__name__}: {e})") from None

    def encode(self, text):
        """Token ids of rendered text: the markers it holds become their special tokens
        (ordinary text that spells a marker does too, as in transformers' encoding). No BOS
        is added: a template that wants one writes {{ bos_token }} (Llama 3's does), as
        transformers' apply_chat_template and vLLM's chat endpoint leave it to the template."""
        return self.tokenizer.encode(text, allowed_special="all")

    def find_end_of_turn_ids(self):
        """The special tokens the template writes right after an assistant's message
        (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Llama 2's </s>): generation stops
        there. Found by rendering a two-turn conversation and reading what follows the
        assistant's words; () when the template writes no special token there."""
        marker = "kvcache-gpt end-of-turn probe"
        try:
            text = self.render([{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": marker}], add_generation_prompt=False)
        except TemplateError:
            return ()
        tail = text.partition(marker)[2].lstrip()
        for name in sorted(self.tokenizer.special_tokens_set, key=len, reverse=True):
            if tail.startswith(name):
                return (self.tokenizer.encode_single_token(name),)
        return ()


def read_template(path):
    """A template file's text, or one TemplateError line."""
    path = Path(path)
    try:
        if path.stat().st_size > TEMPLATE_MAX_BYTES:
            raise TemplateError(f"{path}: larger than {TEMPLATE_MAX_BYTES:,} bytes, not a chat template")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def template_from_file(path, tokenizer):
    """--chat-template FILE: a Jinja file."""
    return ChatTemplate(read_template(path), tokenizer, origin=str(path))


def template_from_hf_dir(path, tokenizer):
    """The chat template a Hugging Face directory ships: chat_template.jinja, or
    tokenizer_config.json's chat_template (a string, or a list of named templates of which
    "default" is used); None when it has none."""
    path = Path(path)
    config = {}
    if (path / "tokenizer_config.json").is_file():
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TemplateError(f"{path / 'tokenizer_config.json'}: not readable JSON ({e})") from None
    config = config if isinstance(config, dict) else {}

    def token(name):  # a string, or {"content": string}
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else None
    if (path / "chat_template.jinja").is_file():
        source, origin = read_template(path / "chat_template.jinja"), path / "chat_template.jinja"
    else:
        source, origin = config.get("chat_template"), path / "tokenizer_config.json"
        if isinstance(source, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise TemplateError(f"{origin}: chat_template must be a string")
    return ChatTemplate(source, tokenizer, token("bos_token"), token("eos_token"), origin=str(origin))
