"""
generate.py's flags for logits processors and structured outputs, and the Processors
(generation/logits_processors.py) they make:

    --repetition-penalty R  --presence-penalty P  --frequency-penalty F  --min-tokens N
    --logit-bias ID:BIAS (repeatable)  --bad-words WORD (repeatable)  --allowed-token-ids 1,2,3
    --json-schema FILE | --json-object | --regex R | --choice A --choice B | --grammar FILE

(--min-p is a sampling filter, beside --top-p: generate.py's own.) A bad value, a token id
outside the vocabulary, or a constraint that does not compile is one line and exit 2.
"""

import argparse
import json

from generation.logits_processors import Processors, bad_word_ids
from generation.structured import compile_constraint
from plumbing.script import UserError
from plumbing.text_input import read_text
from plumbing.text_stream import eos_token_ids

FLAGS = ["--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--logit-bias",
         "--min-tokens", "--bad-words", "--allowed-token-ids", "--json-schema", "--json-object",
         "--regex", "--choice", "--grammar"]


def token_bias(text):
    """ID:BIAS -> (id, bias)."""
    token, sep, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID:BIAS (e.g. 198:-100), got {text!r}") from None


def token_ids(text):
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_processor_args(p):
    g = p.add_argument_group("logits processors (sample.py has their formulas)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the positive logits of tokens already in the text by R, multiply "
                   "the negative ones (transformers' and llama.cpp's; 1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P from the logit of every token already generated (OpenAI's)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times its count from each generated token's logit (OpenAI's)")
    g.add_argument("--logit-bias", type=token_bias, action="append", default=[], metavar="ID:BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no end of text before N new tokens")
    g.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="never generate WORD's tokens (as written, and after a space; repeatable)")
    g.add_argument("--allowed-token-ids", type=token_ids, metavar="IDS",
                   help="generate only these token ids (comma-separated)")
    s = p.add_argument_group("structured outputs (generation/structured.py)").add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE", help="the text is JSON valid under this schema")
    s.add_argument("--json-object", action="store_true", help="the text is a JSON object")
    s.add_argument("--regex", metavar="R", help="the text matches regex R whole (Rust syntax)")
    s.add_argument("--choice", action="append", metavar="TEXT", help="the text is one of these (repeatable)")
    s.add_argument("--grammar", metavar="FILE", help="the text follows this grammar (Lark or llama.cpp's GBNF)")


def constraint_from_args(args, tokenizer):
    """The compiled constraint the flags ask for, or None."""
    if args.json_schema is not None:
        text = read_text(args.json_schema, "--json-schema")
        try:
            kind, spec, flag = "json", json.loads(text), f"--json-schema {args.json_schema}"
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
    elif args.json_object:
        kind, spec, flag = "json_object", None, "--json-object"
    elif args.regex is not None:
        kind, spec, flag = "regex", args.regex, "--regex"
    elif args.choice is not None:
        kind, spec, flag = "choice", args.choice, "--choice"
    elif args.grammar is not None:
        kind, spec, flag = "grammar", read_text(args.grammar, "--grammar"), f"--grammar {args.grammar}"
    else:
        return None
    try:
        return compile_constraint(kind, spec, tokenizer)
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None


def processors_from_args(args, tokenizer):
    """The Processors of the flags (None: none asked for), checked against the vocabulary."""
    try:
        processors = Processors(args.repetition_penalty, args.presence_penalty, args.frequency_penalty,
                                tuple(args.logit_bias), args.min_tokens,
                                bad_word_ids(args.bad_words, tokenizer), args.allowed_token_ids,
                                eos_token_ids(tokenizer), constraint_from_args(args, tokenizer))
        processors.check(tokenizer.n_vocab)
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        field = str(e).split(" ")[0].rstrip(":")
        flag = "--" + field.replace("_", "-") if "--" + field.replace("_", "-") in FLAGS else "a processor flag"
        raise UserError(f"{flag}: {e}") from None
    return processors if processors.active else None


def processor_flags_given(p, args):
    """The processor flags set to anything but their defaults."""
    return [f for f in FLAGS if getattr(args, f[2:].replace("-", "_")) != p.get_default(f[2:].replace("-", "_"))]
