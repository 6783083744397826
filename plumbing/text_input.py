"""
A command's text input: a UTF-8 file or standard input (read_text), a JSON Lines file of
prompts (parse_prompts_file), and text encoded with the user's mistakes as one UserError
line (encode_user_text). plumbing/user_text.py does the encoding itself; the server,
which answers with HTTP errors rather than UserError, uses that directly.
"""

import json
import sys

from plumbing.memory import max_text_bytes
from plumbing.script import UserError
from plumbing.user_text import TextError, check_text, encode_text


def read_text(path, what):
    """The contents of a UTF-8 text file, or one UserError line saying why not. No more is
    read than memory can tokenize: /dev/zero, say, never ends."""
    limit = max_text_bytes()
    if path == "":
        raise UserError(f"{what}: empty path given (an unset shell variable?)")
    if path == "-":
        if sys.stdin is None:  # started with <&-
            raise UserError(f"{what} -: standard input is closed")
        data = sys.stdin.buffer.read(limit + 1)
    else:
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except IsADirectoryError:
            raise UserError(f"{what} {path}: is a directory, expected a text file") from None
        except OSError as e:
            raise UserError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if len(data) > limit:
        raise UserError(f"{what} {path}: more than {limit:,} bytes, more text than this "
                        "machine's memory can tokenize")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


def parse_prompts_file(text, path):
    """JSON Lines: per line a JSON string, or an object with a "prompt" string (so other
    fields may ride along). Lines end at "\\n" only, as JSON Lines says (splitlines() would
    also cut at U+2028, U+0085 or a vertical tab, which a JSON string may hold); blank
    lines are skipped; a JSON string may hold newlines as \\n."""
    prompts = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"--prompts-file {path}: line {number}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not JSON ({getattr(e, 'msg', e)})") from None
        except RecursionError:
            raise UserError(f"{where}: nested too deeply to be a prompt") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise UserError(f"{where}: expected a JSON string or an object with a \"prompt\" string")
        try:
            check_text(prompt)
        except TextError as e:
            raise UserError(f"{where}: {e}") from None
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--prompts-file {path}: no prompts in it")
    return prompts


def encode_user_text(tokenizer, text, what):
    """user_text.encode_text, its refusal as one UserError line that begins with `what`."""
    try:
        return encode_text(tokenizer, text)
    except TextError as e:
        raise UserError(f"{what}: {e}") from None
