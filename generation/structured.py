"""
Structured outputs: text that must match a JSON schema, a regex, a list of choices or a
grammar, enforced one token at a time by a mask over the vocabulary.

    constraint = compile_constraint("json", {"type": "object"}, tokenizer)   # ValueError if bad
    matcher = constraint.matcher()        # one per row: where that row's text is in the grammar
    allowed = matcher.allowed()           # (V,) bool: the tokens that keep the text valid
    logits[~allowed] = -inf               # sample.py's ban(): the model picks among them
    matcher.accept([token])               # the row moves on

The mask is over tokens, and a grammar is over characters: a token may close one grammar
symbol and open the next (`",` ends a JSON string and starts the next member) or be half
of a symbol. So the mask is not a lookup in a table of symbols: for every token, "can the
text so far, plus this token's bytes, still grow into a valid text?". Asked naively, that
is one walk of the grammar per token of a 4,096 (bundled) to 128,256 (Llama 3) vocabulary
at every step. The engine here, llguidance (what llama.cpp and vLLM use), walks the
vocabulary as a trie of token bytes alongside the grammar's lexer: tokens that share a
prefix share the walk, and a branch the lexer rejects is cut with every token under it;
the lexer's states are built once (lazily, and for large regexes ahead: "precomputed
masks" for the lexemes that are most of a JSON text, like a string's body). A step costs
tens of microseconds to a millisecond, not a pass over the vocabulary
(python -m benchmarks.structured measures it against a decode step).

The end-of-text token is allowed exactly when the text so far is complete: a row stops
only with a valid text, and a row that reaches max_tokens first holds a valid prefix.

Kinds (vLLM's structured_outputs names): "json" (a JSON schema, a dict or its text),
"json_object" (any JSON object; spec None), "regex" (Rust regex syntax, matched whole),
"choice" (a list of strings: the text is exactly one of them), "grammar" (Lark syntax as
llguidance reads it, or llama.cpp's GBNF, told apart by GBNF's `::=`).
"""

import json
import time
from functools import lru_cache

import torch

from plumbing.text_stream import eos_token_ids

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar past this is refused before compiling
# Work bounds, in llguidance's own units of effort rather than seconds, so that a hostile
# grammar fails the same way on every machine: building the lexer (at llguidance's stated
# ~50k units a ms, ~40 ms), the grammar's size, and one step's mask (~14k a ms: ~15 ms).
LIMITS = dict(initial_lexer_fuel=2_000_000, max_grammar_size=200_000, step_lexer_fuel=200_000)
COMPILE_SECONDS = 5.0  # and a wall-clock backstop on the compilation, checked after it
                       # (generous: a loaded machine must not refuse a fair schema)


def llguidance():
    """The grammar engine, imported when a constraint is first asked for."""
    try:
        import llguidance
        import llguidance.gbnf_to_lark
    except ImportError:
        raise ValueError("structured outputs need the llguidance package "
                         "(pip install -r requirements.txt)") from None
    return llguidance


class TokenBytes:
    """What llguidance asks of a tokenizer, from the two kinds we load (a tiktoken Encoding,
    plumbing/hf_tokenizer.py's HFTokenizer; both decode_single_token_bytes): every token's
    bytes, which ids are special (never matched as text) and an encoder for text."""

    def __init__(self, tokenizer, end_ids):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = end_ids[0], None
        self.tokens = [tokenizer.decode_single_token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = sorted(tokenizer.encode_single_token(t)
                                        for t in tokenizer.special_tokens_set)

    def __call__(self, text):
        return self.tokenizer.encode_ordinary(text.decode("utf-8", errors="replace"))


@lru_cache(maxsize=8)
def engine_tokenizer(tokenizer):
    """llguidance's view of a tokenizer (its token trie), built once per tokenizer: ~20 ms
    for the bundled 4,096 tokens."""
    llg = llguidance()
    end_ids = eos_token_ids(tokenizer)
    return llg.LLTokenizer(llg.TokenizerWrapper(TokenBytes(tokenizer, end_ids)),
                           n_vocab=tokenizer.n_vocab, eos_token=list(end_ids))


def grammar_text(kind, spec):
    """llguidance's grammar for a (kind, spec) pair; ValueError for a spec of the wrong type."""
    llg = llguidance()
    LLMatcher = llg.LLMatcher
    if kind == "json_object":
        spec = {"type": "object"}
    if kind in ("json", "json_object"):
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not JSON ({e})") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(spec).__name__}")
        check_size(json.dumps(spec), "the JSON schema")
        # one separator, no optional whitespace: a sampled text cannot wander in blank space
        return LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError("choice needs a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in spec):
            raise ValueError("every choice must be a non-empty string")
        check_size("".join(spec), "the choices")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a {kind} must be a non-empty string")
    check_size(spec, f"the {kind}")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        try:
            lark = llg.gbnf_to_lark.any_to_lark(spec)
        except Exception as e:  # the converter's own errors, one line of them
            raise ValueError(f"the grammar is neither Lark nor GBNF: {one_line(e)}") from None
        return LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")


def check_size(text, what):
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{what} has {len(text):,} characters; at most {MAX_SPEC_CHARS:,}")


def one_line(error):
    """An engine's error in one line: its first line, and the line that says what is wrong
    where the engine writes one apart ("error: unclosed group", under a picture of where)."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    if not lines:
        return type(error).__name__
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    return (lines[0] if reason is None else f"{lines[0]} {reason[len('error:'):].strip()}")[:300]


def compile_constraint(kind, spec, tokenizer):
    """A Constraint for (kind, spec) over tokenizer's vocabulary, or ValueError with one
    line: a spec of the wrong type, a schema, regex or grammar the engine cannot compile,
    one past the size or work bounds (LIMITS, COMPILE_SECONDS), or one no text can match."""
    llg, vocabulary = llguidance(), engine_tokenizer(tokenizer)  # once per tokenizer: not timed
    t0 = time.perf_counter()
    grammar = grammar_text(kind, spec)
    template = llg.LLMatcher(vocabulary, grammar, log_level=0,
                             limits=llg.LLParserLimits(**LIMITS))
    if template.is_error():
        raise ValueError(f"the {kind} constraint does not compile: {one_line(template.get_error())}")
    seconds = time.perf_counter() - t0
    if seconds > COMPILE_SECONDS:
        raise ValueError(f"the {kind} constraint took {seconds:.1f} s to compile; at most "
                         f"{COMPILE_SECONDS} s: simplify it")
    constraint = Constraint(kind, template, tokenizer.n_vocab, eos_token_ids(tokenizer))
    first = constraint.matcher()
    if not first.allowed().any():  # the engine finds a dead grammar at its first mask
        raise ValueError(f"the {kind} constraint matches no text "
                         f"({one_line(first.matcher.get_error()) or 'no token can start it'})")
    return constraint


class Constraint:
    """A compiled constraint: shared by every row that asks for it, read-only. Each row
    gets a Matcher of its own (matcher())."""

    def __init__(self, kind, template, vocab_size, end_ids):
        self.kind, self.template, self.vocab_size, self.end_ids = kind, template, vocab_size, end_ids

    def matcher(self, stop_ids=()):
        """A row's state, at the start of the text. stop_ids: more tokens that end the text
        (a chat template's end of turn), allowed where the end-of-text token is."""
        return Matcher(self.template.deep_copy(), self.vocab_size,
                       tuple(dict.fromkeys((*self.end_ids, *stop_ids))))


# bit b of a mask word is token 32 * word + b (llguidance's layout: int32 words)
BITS = torch.arange(32, dtype=torch.int32)


def unpack_bits(words, vocab_size):
    """llguidance's bitmask (..., ceil(V / 32)) int32 -> (..., V) bool."""
    bits = (words[..., None] >> BITS) & 1                                   # (..., W, 32)
    return bits.flatten(-2)[..., :vocab_size].bool()


class Matcher:
    """One row's place in the grammar: the tokens it may take next (allowed), the tokens it
    took (accept), and back (rollback, for proposals a speculative step did not keep)."""

    def __init__(self, matcher, vocab_size, end_ids):
        self.matcher, self.vocab_size, self.end_ids = matcher, vocab_size, end_ids
        self.words = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self.taken, self.ended_at = 0, None  # tokens taken; how many when the text ended

    def allowed(self):
        """(V,) bool: the tokens that keep the text valid. All False once the text has
        ended (an end-of-text token taken) or the matcher is in error (a step past the work
        bound): the row can take no token and ends."""
        if self.ended_at is not None:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        if self.matcher.is_error():
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed = unpack_bits(self.words[0], self.vocab_size)
        # every id that ends a text may end it where the grammar's end-of-text token may
        allowed[list(self.end_ids)] = bool(allowed[self.end_ids[0]])
        return allowed

    def accept(self, tokens):
        """The row took tokens (a list); an end-of-text id is the grammar's end."""
        for token in tokens:
            if self.ended_at is not None:
                return
            if token in self.end_ids:
                self.ended_at = self.taken + 1
                token = self.end_ids[0]
            self.matcher.consume_token(token)
            self.taken += 1

    def rollback(self, n):
        """Forget the last n tokens taken."""
        self.matcher.rollback(n)
        self.taken -= n
        if self.ended_at is not None and self.taken < self.ended_at:
            self.ended_at = None

    def allowed_along(self, tokens):
        """(len(tokens) + 1, V) bool: the allowed tokens now and after each of tokens in
        turn (a speculative step's proposals), the matcher left where it was. Past the
        first token it refuses, nothing is allowed: those positions are never reached."""
        masks = torch.zeros(len(tokens) + 1, self.vocab_size, dtype=torch.bool)
        taken = 0
        for i in range(len(tokens) + 1):
            masks[i] = self.allowed()
            if i == len(tokens) or not masks[i, tokens[i]]:
                break
            self.accept([tokens[i]])
            taken += 1
        self.rollback(taken)
        return masks

    def is_done(self):
        """No token but the end of text can follow (the text is complete)."""
        return self.matcher.is_stopped()
