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

A template is a program from a file: every render runs on a budget (template_limits.py)
of steps, seconds and characters, and the file is read only when it is a regular file of
at most TEMPLATE_MAX_BYTES.
"""

import json
import os
import stat
from datetime import datetime
from pathlib import Path

from plumbing.text_stream import eos_token_ids
from serving.template_limits import RENDER_MAX_CHARS, BoundedSandbox, RenderLimit, render_budget

ROLES = ("system", "user", "assistant", "developer", "tool")
# real templates are a few KB; Jinja compiles 256 KB in ~10 s on a busy 2-core machine
TEMPLATE_MAX_BYTES = 1 << 18


class TemplateError(ValueError):
    """A template that cannot be read or rendered (a message saying which and why)."""


class TemplateTooCostly(TemplateError):
    """A render that went past a bound of template_limits.py: a template that does this on
    the end-of-turn probe does it on every request, so it is refused at load."""


def raise_exception(message):  # what templates call to refuse a conversation
    raise TemplateError(" ".join(str(message)[:500].split()))  # one line, not a page


class ChatTemplate:
    def __init__(self, source, tokenizer, bos_token=None, eos_token=None, origin="the template"):
        """source: the Jinja text; bos_token / eos_token: the strings the template may
        insert (tokenizer_config.json's; by default eos_token is the text of the tokenizer's
        first end-of-sequence id, and bos_token that of its BOS, or eos_token's without one)."""
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                        indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            with render_budget():  # Jinja evaluates filters of constants as it compiles
                self.template = env.from_string(source)
        except Exception as e:  # Jinja's errors, and Python's own on code nested too deep
            raise TemplateError(f"{origin}: not a Jinja template ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
        self.tokenizer, self.origin = tokenizer, origin
        end_of_text = tokenizer.decode([eos_token_ids(tokenizer)[0]])
        begin = getattr(tokenizer, "bos_token_id", None)  # a Llama tokenizer's (hf_tokenizer.py)
        begin = end_of_text if begin is None else tokenizer.decode([begin])
        self.bos_token = begin if bos_token is None else bos_token
        self.eos_token = end_of_text if eos_token is None else eos_token
        self.end_of_turn_ids = self.find_end_of_turn_ids()

    def render(self, messages, add_generation_prompt=True, **variables):
        """The conversation as the model reads it; with add_generation_prompt, followed by
        the header of the assistant's turn, for the model to write. Written piece by piece
        (generate), so that a prompt past RENDER_MAX_CHARS stops as it passes it."""
        text, written = [], 0
        try:
            with render_budget():
                for piece in self.template.generate(
                        messages=messages, add_generation_prompt=add_generation_prompt,
                        bos_token=self.bos_token, eos_token=self.eos_token, **variables):
                    written += len(piece)
                    if written > RENDER_MAX_CHARS:
                        raise RenderLimit(f"it writes more than {RENDER_MAX_CHARS:,} characters")
                    text.append(piece)
        except TemplateError:
            raise
        except RenderLimit as e:
            raise TemplateTooCostly(f"{self.origin} was stopped: {e}") from None
        except Exception as e:  # a template is a program: any error is the template's
            raise TemplateError(f"{self.origin} failed on these messages "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
        prompt = "".join(text)
        if not prompt:  # nothing for the model to read: an empty prompt is no request
            raise TemplateError(f"{self.origin} rendered these messages as an empty prompt")
        return prompt

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
        except TemplateTooCostly:
            raise
        except TemplateError:  # a template that refuses this conversation: no end of turn
            return ()
        tail = text.partition(marker)[2].lstrip()
        for name in sorted(self.tokenizer.special_tokens_set, key=len, reverse=True):
            if tail.startswith(name):
                return (self.tokenizer.encode_single_token(name),)
        return ()


def read_template(path):
    """A template file's text, or one TemplateError line. Only a regular file is read, and
    only its first TEMPLATE_MAX_BYTES + 1 bytes: /dev/zero would be read without end, and a
    FIFO would wait for a writer (opened without blocking, it is refused instead)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TemplateError(f"{path}: not a regular file, so not a chat template")
            data = file.read(TEMPLATE_MAX_BYTES + 1)
        if len(data) > TEMPLATE_MAX_BYTES:
            raise TemplateError(f"{path}: larger than {TEMPLATE_MAX_BYTES:,} bytes, not a chat template")
        return data.decode("utf-8")
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
            source = named_template(source, origin)
        if source is None:
            return None
        if not isinstance(source, str):
            raise TemplateError(f"{origin}: chat_template must be a string")
        if len(source.encode("utf-8", "surrogatepass")) > TEMPLATE_MAX_BYTES:
            raise TemplateError(f"{origin}: its chat_template is larger than {TEMPLATE_MAX_BYTES:,} "
                                "bytes, not a chat template")
    return ChatTemplate(source, tokenizer, token("bos_token"), token("eos_token"), origin=str(origin))


def named_template(templates, origin):
    """tokenizer_config.json's list of named templates: the one named "default" (None
    when none is), each entry checked to be {"name": string, "template": string}."""
    for i, entry in enumerate(templates):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise TemplateError(f"{origin}: chat_template[{i}] must be "
                                '{"name": string, "template": string}')
    return next((t["template"] for t in templates if t["name"] == "default"), None)
