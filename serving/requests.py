"""
What a caller hands the engine and what it gets back:

    SamplingParams   what one sample asks for (max_tokens, temperature, stop, ...)
    Request          a scheduler Sequence plus its SamplingParams, its text so far and
                     the callback that receives each Output
    Output           what one step gave a request: new text, the token, its Logprob, and
                     why it ended, when it did
    Logprob          a token's log-probability and the likeliest tokens at its position
"""

import time
from dataclasses import dataclass

import torch

from generation.logits_processors import Processors, RowProcessing, bad_word_ids
from generation.speculative import PromptLookup
from generation.structured import KINDS, compile_constraint
from plumbing.text_stream import SampleText, eos_token_ids
from sample import check_sampling_args
from serving.scheduler import Sequence


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. The names are vLLM's."""
    max_tokens: int = 16      # 0: the prefill only (to score the prompt, or cache it)
    temperature: float = 1.0
    top_k: int = None
    top_p: float = None
    seed: int = None          # its own torch.Generator: the same seed, the same text
    stop: tuple = ()          # strings that end the text (not included in it)
    stop_token_ids: tuple = ()  # tokens that end it (a chat template's end of turn), always
    stop_at_eot: bool = True  # False: the end-of-text token does not end it (benchmarks)
    logprobs: int = None      # each new token's log-probability and the `logprobs` likeliest
    prompt_logprobs: int = None  # the same for every prompt token but the first
    # logits processors (sample.py has their formulas; generation/logits_processors.py)
    repetition_penalty: float = 1.0   # multiplicative, over prompt and output tokens
    presence_penalty: float = 0.0     # OpenAI's, additive, over output tokens
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple = ()            # ((token_id, bias), ...) (or a dict), int ids, bias in [-100, 100]
    min_tokens: int = 0               # end-of-text and stop tokens banned until this many
    bad_words: tuple = ()             # strings; their tokens as written and after a space
    allowed_token_ids: tuple = None   # only these may be drawn
    # structured outputs (generation/structured.py): (kind, spec), kind one of
    # structured.KINDS: "json" (a JSON-schema dict or its text), "json_object" (None),
    # "regex" (a str, Rust syntax), "choice" (a list of str), "grammar" (Lark or GBNF text)
    structured: tuple = None
    include_stop_str_in_output: bool = False
    # speculative decoding (serving/speculation.py): up to `speculate` tokens proposed per
    # step by prompt lookup of n-grams up to `prompt_lookup` long; None: the engine's
    # (serve.py --speculate, --prompt-lookup), speculate=0: none
    speculate: int = None
    prompt_lookup: int = None

    def check(self):
        """ValueError (one line) for a setting that has no meaning, without the tokenizer
        (token ids and the constraint are checked by processors())."""
        check_sampling_args(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.structured is not None and (len(self.structured) != 2 or self.structured[0] not in KINDS):
            raise ValueError(f"structured must be (kind, spec), kind one of {', '.join(KINDS)}")
        if any(not s for s in self.stop):
            raise ValueError("a stop string must not be empty")
        if self.prompt_lookup is not None and not 1 <= self.prompt_lookup <= PromptLookup.MAX_NGRAM:
            raise ValueError(f"prompt_lookup must be 1..{PromptLookup.MAX_NGRAM}, got {self.prompt_lookup}")
        for name in ("logprobs", "prompt_logprobs", "speculate"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.processor_settings(()).check(2 ** 62)  # ranges now; ids against the vocabulary later

    def processor_settings(self, bad_words, constraint=None, end_ids=()):
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        return Processors(self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                          tuple(bias), self.min_tokens, bad_words,
                          None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                          end_ids, constraint)

    def processors(self, tokenizer, vocab_size):
        """The Processors of these settings for this tokenizer, checked (ValueError: a token
        id outside the vocabulary, a constraint that does not compile), or None when
        none changes anything. Its constraint is compiled here, once for every sample."""
        constraint = None if self.structured is None else compile_constraint(*self.structured, tokenizer)
        end_ids = tuple(dict.fromkeys((*eos_token_ids(tokenizer), *self.stop_token_ids)))
        processors = self.processor_settings(bad_word_ids(self.bad_words, tokenizer), constraint, end_ids)
        processors.check(vocab_size)
        return processors if processors.active else None


@dataclass
class Logprob:
    """A token's log-probability under the model (its raw distribution: before temperature,
    top-k or top-p, as vLLM reports it) and the `top` likeliest tokens, [(token, logprob)]."""
    token: int
    logprob: float
    top: list


@dataclass
class Output:
    """What one step gave a request: the new text (held back while it may still become a
    stop string or half a character), the token, its Logprob (when asked for), and why it
    ended, when it did: "stop" (end of text, a stop token or string), "length"
    (max_tokens), "cancelled", "error"."""
    text: str
    token: int = None
    finish_reason: str = None
    logprob: Logprob = None


class Request(Sequence):
    """A sequence plus what the caller asked for and what it has been given."""

    def __init__(self, prompt, params, on_output, tokenizer, device, processors=None, lookup=None):
        """processors: params.processors(tokenizer, ...), made once for a request's samples.
        lookup: its speculation.Lookup when it speculates, else None."""
        super().__init__(prompt)
        self.params, self.on_output, self.lookup = params, on_output, lookup
        self.text = SampleText(tokenizer, list(params.stop), params.stop_at_eot,
                               params.stop_token_ids, params.include_stop_str_in_output)
        # each sample's own state: its output so far, its place in the grammar
        self.processing = processors and RowProcessing(processors, prompt)
        self.score_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs = None  # [None, Logprob of token 1, ...] once the prefill ran
        self.shown = 0  # characters of text handed out
        self.generator = (None if params.seed is None else
                          torch.Generator(device=device).manual_seed(params.seed))
        self.finish_reason, self.error = None, None
        self.arrival_time = time.perf_counter()
        self.token_times = []  # when each token was handed out (for the benchmark)

    @property
    def num_generated(self):
        return len(self.tokens) - self.prompt_len

    @property
    def draws_alone(self):
        """Drawn by sample() with its own settings, not in the batch's draw: one with logits
        processors (they read its own text), a seeded request (its generator must give the
        text generate() gives the seed) or one with top-k, top-p or min-p (they filter the
        vocabulary, which the batch should not pay for every row)."""
        p = self.params
        return self.processing is not None or p.temperature > 0 and (
            self.generator is not None or p.top_k is not None
            or (p.top_p is not None and p.top_p < 1) or p.min_p > 0)
