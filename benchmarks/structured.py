"""
Structured outputs measured (generation/structured.py): what the mask costs per decode
step, and whether every constrained output is valid.

    python -m benchmarks.structured --cost        # the mask against a decode step
    python -m benchmarks.structured --validity    # ~200 random constraints, both bundled models

--cost: one row's mask (llguidance's mask, unpacked, applied: RowProcessing) at each step
of a JSON text, against a plain decode step of the same model at batch 1: the bundled
model with its 4,096-token tokenizer, and a random Llama-3.2-1B-shaped model with a
128,256-token vocabulary (no Llama 3 tokenizer is on disk: its tokens here are the bundled
ones, the corpus's words and random letter strings, enough to size the token trie; the
mask's cost is the trie walk's, so this is an estimate of the real one's).

--validity: random JSON schemas, regexes and choice lists, sampled at temperature 1 through
generate_tokens (a constraint per row), plain, with prompt lookup and with the bundled
draft: every row that ends must parse and validate (jsonschema; Python's re for the
regexes, which use only syntax both dialects read the same), the rest must be prefixes
the grammar accepts.
"""

import argparse
import json
import random
import re
import statistics
import time

from plumbing.script import begin, run

if __name__ == "__main__":
    begin()

import torch  # noqa: E402

from generation.logits_processors import Processors, RowProcessing  # noqa: E402
from generation.loop import generate_tokens  # noqa: E402
from generation.speculative import DraftModel, PromptLookup  # noqa: E402
from generation.structured import compile_constraint  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import load_model  # noqa: E402
from plumbing.text_stream import eos_token_ids  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["king", "queen", "fool"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
TEXT = '{"name":"Romeo, Montague","age":17,"tags":["king","fool"]}'


class SyntheticTokenizer:
    """A 128,256-token vocabulary for sizing the mask (see the module's docstring)."""

    def __init__(self, base, n_vocab=128256, seed=0):
        tokens = {bytes([b]) for b in range(256)}
        tokens |= {base.decode_single_token_bytes(i) for i in range(base.n_vocab)}
        words = open("checkpoints/shakespeare/heldout.txt", encoding="utf-8").read().split()
        tokens |= {w.encode() for w in words} | {b" " + w.encode() for w in words}
        rng = random.Random(seed)
        while len(tokens) < n_vocab - 1:
            tokens.add((" " if rng.random() < 0.5 else "").encode()
                       + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))).encode())
        self.table = sorted(tokens, key=lambda t: (len(t), t))[:n_vocab - 1] + [b"<|eot|>"]
        self.n_vocab, self.eot_token = n_vocab, n_vocab - 1
        self.special_tokens_set = {"<|eot|>"}
        self.ids = {t: i for i, t in enumerate(self.table)}

    def decode_single_token_bytes(self, token):
        return self.table[token]

    def encode_single_token(self, text):
        return self.ids[text.encode()]

    def encode_ordinary(self, text):  # greedy longest match: enough to spell TEXT
        data, out, i = text.encode(), [], 0
        while i < len(data):
            j = next(j for j in range(min(len(data), i + 12), i, -1) if data[i:j] in self.ids)
            out.append(self.ids[data[i:j]])
            i = j
        return out


def mask_seconds(tokenizer, vocab):
    """The median seconds of one step's mask along TEXT's tokens."""
    processors = Processors(end_ids=eos_token_ids(tokenizer), constraint=compile_constraint("json", SCHEMA, tokenizer))
    row, times = RowProcessing(processors, [0]), []
    logits = torch.randn(1, vocab)
    for token in tokenizer.encode_ordinary(TEXT):
        t0 = time.perf_counter()
        out = row(logits)
        times.append(time.perf_counter() - t0)
        assert not torch.isneginf(out[0, token]), "the text must stay allowed"
        row.accept([token])
    return statistics.median(times)


def step_seconds(model, n=16):
    """Seconds per plain decode step at batch 1 (after the prefill)."""
    generate_tokens(model, [[1] * 8], 4, temperature=0)  # warm-up
    t0 = time.perf_counter()
    generate_tokens(model, [[1] * 8], 1, temperature=0)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate_tokens(model, [[1] * 8], n + 1, temperature=0)
    return (time.perf_counter() - t0 - prefill) / n


def cost():
    model, tok = load_model(CACHED_MODELS, "checkpoints/shakespeare/ckpt.pt", report=lambda *_: None)
    rows = [("bundled (4,096 tokens)", mask_seconds(tok, tok.n_vocab), step_seconds(model))]
    from benchmarks.llama_speed import SHAPES, random_llama
    big = SyntheticTokenizer(tok)
    mask = mask_seconds(big, big.n_vocab)
    llama = random_llama(SHAPES["llama-3.2-1b"])
    rows.append(("Llama-3.2-1B shape (128,256 tokens)", mask, step_seconds(llama, n=4)))
    print(f"{'model':38s} {'mask/step':>10s} {'decode step':>12s} {'mask / step':>12s}")
    for name, m, s in rows:
        print(f"{name:38s} {m * 1e3:8.2f} ms {s * 1e3:9.1f} ms {m / s:11.1%}")


# ---------------------------------------------------------------------------- validity

def random_constraint(rng):
    kind = rng.choice(["json", "regex", "choice"])
    if kind == "choice":
        return kind, rng.sample(["ROMEO", "JULIET", "yes", "no", "my lord", "O, woe!", "Tybalt"], rng.randint(2, 5))
    if kind == "regex":
        return kind, rng.choice([r"[A-Z][a-z]{2,8}(, [a-z]{2,8}){0,3}[.!?]", r"(ROMEO|JULIET|NURSE): [a-z ]{5,30}\.",
                                 r"[0-9]{1,4}( [a-z]{3,6}){1,3}", r"(thou|thee|thy)( [a-z]+){1,4}!"])
    props = {}
    for i in range(rng.randint(1, 4)):
        props[f"k{i}"] = rng.choice([{"type": "string", "maxLength": rng.randint(3, 25)},
                                     {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)},
                                     {"type": "boolean"}, {"enum": ["a", "b", "c"]},
                                     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "maxItems": 4}])
    return "json", {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def valid(kind, spec, text):
    if kind == "choice":
        return text in spec
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), spec)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def validity(n, max_tokens):
    rng = random.Random(0)
    draft, _ = load_model(CACHED_MODELS, "checkpoints/shakespeare-draft/ckpt.pt", report=lambda *_: None)
    for path in ("checkpoints/shakespeare/ckpt.pt", "checkpoints/shakespeare-llama/ckpt.pt"):
        model, tok = load_model(CACHED_MODELS, path, report=lambda *_: None)
        for mode, options in [("plain", {}), ("prompt lookup", dict(speculate=3, proposer=PromptLookup(3))),
                              ("draft", dict(speculate=3, proposer=DraftModel(draft)))]:
            specs = [random_constraint(rng) for _ in range(n)]
            rows = [Processors(end_ids=eos_token_ids(tok), constraint=compile_constraint(k, s, tok)) for k, s in specs]
            prompt = tok.encode_ordinary("ROMEO:\n")
            out = []
            for i in range(0, n, 20):  # batches of 20 rows, each its own constraint
                out += generate_tokens(model, [prompt] * len(rows[i:i + 20]), max_tokens, temperature=1.0,
                                       processors=rows[i:i + 20], vocab_limit=tok.n_vocab,
                                       generator=torch.Generator().manual_seed(i), **options).tolist()
            finished = ok = prefixes = 0
            for (kind, spec), p, tokens in zip(specs, rows, out):
                tokens = [t for t in tokens if t >= 0]
                ends = [t for t in tokens if t in p.end_ids]
                if ends:
                    finished += 1
                    ok += valid(kind, spec, tok.decode(tokens[:tokens.index(ends[0])]))
                else:
                    matcher = p.constraint.matcher()
                    prefixes += all(matcher.allowed()[t] and not matcher.accept([t]) for t in tokens)
            print(f"{path.split('/')[1]:20s} {mode:14s} {n} requests: {finished} finished, {ok} of them valid; "
                  f"{n - finished} at max_tokens={max_tokens}, {prefixes} of them valid prefixes")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--cost", action="store_true")
    p.add_argument("--validity", action="store_true")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    if args.cost or not args.validity:
        cost()
    if args.validity or not args.cost:
        validity(args.requests, args.max_tokens)


if __name__ == "__main__":
    run(main)
