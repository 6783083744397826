"""Speculative decoding in the serving engine (serving/speculation.py): greedy text is the
text without it, token for token, for requests that speculate beside requests that do
not, across block boundaries, preemption and reprefill; sampling keeps the model's
distribution (the chi-square test of test_speculative.py, through the engine); the
rejected proposals' blocks go back to the pool, and so do a cancelled request's.

Token equality is exact for the reason test_serving_engine.py gives: a verification row
computes a decode row's arithmetic in a differently shaped matmul (~1e-6 apart), and
greedy argmax flips only at near-ties, which these seeds lack. Log-probabilities: 1e-4
absolute (fp32), as test_batch.py allows between batch shapes."""

import pytest
import torch

from base_model import GPTConfig
from conftest import assert_pool_is_whole, byte_tokenizer, random_prompts, tiny_model
from generation import speculative
from serving.engine import Engine, SamplingParams
from serving.metrics import ServerMetrics
from test_speculative import L, PROMPT, V, chi_square_p_value, exact_distribution

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
GREEDY = dict(temperature=0, stop_at_eot=False)
REPEATING = [5, 6, 7, 8, 9] * 4  # prompt lookup has what to propose from the start


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def generate(engine, prompts, speculate, **params):
    """The new tokens of each prompt, its request speculating at speculate[i] (0: not)."""
    requests = [engine.add_request(p, SamplingParams(speculate=k, **params))
                for p, k in zip(prompts, speculate)]
    engine.run_until_done()
    return [r.tokens[r.prompt_len:] for r in requests]


@pytest.mark.parametrize("tokens_per_block, attention", [(1, "kernel"), (8, "kernel"),
                                                         (16, "kernel"), (8, "gather")])
def test_greedy_text_is_the_text_without_speculation(model, tokens_per_block, attention):
    # every other request speculates, in the same batch as the rest; 100 tokens go past
    # the context (64): each row reprefills too
    prompts = [REPEATING, *random_prompts([1, 9, 17, 40, 64])]
    plain = generate(Engine(model, TOKENIZER, tokens_per_block=tokens_per_block, attention=attention),
                     prompts, [0] * len(prompts), max_tokens=100, **GREEDY)
    engine = Engine(model, TOKENIZER, tokens_per_block=tokens_per_block, attention=attention)
    assert generate(engine, prompts, [4, 0, 4, 0, 8, 1], max_tokens=100, **GREEDY) == plain
    stats = engine.stats()
    assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]  # both outcomes were taken
    assert_pool_is_whole(engine)


def test_the_engines_default_and_a_pool_that_preempts(model):
    """Engine(speculate=...) for every request that does not say; a pool of 12 blocks of 8
    for 6 sequences that grow to 100 tokens: preemption, recomputed from tokens that
    include accepted proposals, and proposals that find no free block are not made."""
    prompts = [REPEATING, *random_prompts([3, 12, 30, 7, 21], seed=4)]
    plain = generate(Engine(model, TOKENIZER, tokens_per_block=8), prompts, [0] * 6,
                     max_tokens=100, **GREEDY)
    engine = Engine(model, TOKENIZER, tokens_per_block=8, num_blocks=12, speculate=6, prompt_lookup=2)
    assert generate(engine, prompts, [None] * 6, max_tokens=100, **GREEDY) == plain
    assert engine.scheduler.preemptions > 0 and engine.stats()["accepted_tokens"] > 0
    assert_pool_is_whole(engine)


def test_a_full_batch_leaves_no_rows_for_proposals(model):
    """A pass has at most max_batch rows: 4 requests in a batch of 4 speculate not at all,
    and once one has finished, the others share the rows it left."""
    prompts = [REPEATING] * 4
    engine = Engine(model, TOKENIZER, max_batch=4, speculate=4)
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, **GREEDY))
                for p, n in zip(prompts, (2, 30, 30, 30))]
    while requests[0].state != "finished":
        engine.step()
    assert engine.proposed_tokens == 0
    engine.run_until_done()
    assert engine.proposed_tokens > 0


def test_stop_strings_max_tokens_and_streaming_among_accepted_tokens(model):
    """The tokens a verification gives are handed out one Output each: a stop string or
    max_tokens that falls among them ends the text where it ends without speculation."""
    def outputs(speculate, **params):
        engine = Engine(model, TOKENIZER)
        got = []
        request = engine.add_request(REPEATING, SamplingParams(speculate=speculate, **params),
                                     lambda r, output: got.append(output))
        engine.run_until_done()
        assert_pool_is_whole(engine)
        return request, got

    plain, plain_outputs = outputs(0, max_tokens=40, **GREEDY)
    text = "".join(o.text for o in plain_outputs)
    stop = text[17:19]  # a stop string that the speculating request meets mid-verification
    for params in (dict(max_tokens=37), dict(max_tokens=40, stop=[stop])):
        want, want_outputs = outputs(0, **params, **GREEDY)
        got, got_outputs = outputs(8, **params, **GREEDY)
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        assert [o.text for o in got_outputs] == [o.text for o in want_outputs]  # one per token
    assert want.finish_reason == "stop" and len(want.tokens) < len(plain.tokens)


def test_logprobs_and_processors_match_the_plain_pass(model):
    params = dict(max_tokens=30, logprobs=3, repetition_penalty=1.3, logit_bias={7: 2.0}, **GREEDY)
    results = []
    for speculate in (0, 4):
        engine = Engine(model, TOKENIZER)
        got = []
        engine.add_request(REPEATING, SamplingParams(speculate=speculate, **params),
                           lambda r, output: got.append(output.logprob))
        engine.run_until_done()
        results.append([lp for lp in got if lp is not None])
    assert engine.accepted_tokens > 0
    plain, speculated = results
    assert [lp.token for lp in speculated] == [lp.token for lp in plain]
    for a, b in zip(plain, speculated):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_cancelled_speculating_request_frees_its_blocks(model):
    engine = Engine(model, TOKENIZER, tokens_per_block=4)
    request = engine.add_request(REPEATING, SamplingParams(max_tokens=40, speculate=8, **GREEDY))
    while engine.accepted_tokens == 0:
        engine.step()
    assert request.state == "running" and request.proposed == 0  # between steps: no proposal held
    engine.cancel(request)
    engine.run_until_done()
    assert request.finish_reason == "cancelled"
    assert_pool_is_whole(engine)


def test_metrics_count_proposed_and_accepted_tokens(model):
    engine = Engine(model, TOKENIZER)
    generate(engine, [REPEATING], [4], max_tokens=20, **GREEDY)
    page = ServerMetrics(engine).page().decode()
    assert f"kvcache_spec_decode_num_draft_tokens_total {float(engine.proposed_tokens)}" in page
    assert f"kvcache_spec_decode_num_accepted_tokens_total {float(engine.accepted_tokens)}" in page


def test_settings_that_have_no_meaning_are_refused(model):
    engine = Engine(model, TOKENIZER)
    for params, message in ((dict(speculate=-1), "speculate must be >= 0"),
                            (dict(speculate=2, prompt_lookup=17), "prompt_lookup must be 1..16"),
                            (dict(speculate=64), "below the model's context")):
        with pytest.raises(ValueError, match=message):
            engine.add_request([1, 2], SamplingParams(**params))
    with pytest.raises(ValueError, match="prompt_lookup"):
        Engine(model, TOKENIZER, speculate=2, prompt_lookup=0)


# ---------------------------------------------------------------------------- a draft model

@pytest.mark.parametrize("draft_of", ["itself", "another", "a short context"])
def test_a_drafts_greedy_text_is_the_text_without_speculation(model, draft_of):
    # serve.py --draft: a speculating request is proposed the draft's greedy tokens. The
    # model as its own draft (every proposal taken), another random model (most rejected:
    # the draft's cache rolls back to what the text keeps), and one whose context (16) the
    # requests outgrow (the draft starts again from the text's newest part)
    draft = {"itself": model, "another": tiny_model(CONFIG, seed=8),
             "a short context": tiny_model(GPTConfig(context_len=16, vocab_size=260, n_layer=1, n_head=2,
                                                     n_embd=32), seed=9)}[draft_of]
    prompts = [REPEATING, *random_prompts([1, 9, 40], seed=2)]
    plain = generate(Engine(model, TOKENIZER, tokens_per_block=8), prompts, [0] * 4, max_tokens=100, **GREEDY)
    engine = Engine(model, TOKENIZER, tokens_per_block=8, draft=draft)
    assert generate(engine, prompts, [4, 0, 3, 6], max_tokens=100, **GREEDY) == plain
    stats = engine.stats()
    if draft_of == "itself":
        assert stats["accepted_tokens"] == stats["proposed_tokens"] > 0
    else:
        assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
    assert_pool_is_whole(engine)


def test_a_request_naming_prompt_lookup_keeps_it_beside_a_draft(model):
    engine = Engine(model, TOKENIZER, draft=tiny_model(CONFIG, seed=8))
    drafted = engine.add_request(REPEATING, SamplingParams(max_tokens=5, speculate=2, **GREEDY))
    looked_up = engine.add_request(REPEATING, SamplingParams(max_tokens=5, speculate=2, prompt_lookup=2,
                                                            **GREEDY))
    assert type(drafted.lookup).__name__ == "Draft" and type(looked_up.lookup).__name__ == "Lookup"
    engine.run_until_done()


def test_a_draft_with_fewer_tokens_than_the_tokenizer_is_refused(model):
    short = tiny_model(GPTConfig(context_len=64, vocab_size=200, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="vocabulary of 200 tokens is smaller than the tokenizer's 257"):
        Engine(model, TOKENIZER, draft=short)


# ---------------------------------------------------------------------------- distribution

class Letters:
    """A tokenizer of test_speculative.py's V tokens, one letter each, no end of text."""
    n_vocab, eot_token = V, -1

    def decode_single_token_bytes(self, token):
        return bytes([97 + token])


@pytest.fixture(scope="module")
def small():
    model = tiny_model(GPTConfig(context_len=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16), seed=41)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # test_speculative.py's model: acceptance varies
    return model


def engine_samples(model, n, wave=32, draft=None, **params):
    """The first L tokens of n samples of PROMPT, speculating (3 proposals: 2-grams, or the
    draft's greedy tokens), in waves of `wave` requests so that the batch leaves rows for
    proposals."""
    torch.manual_seed(5)
    engine = Engine(model, Letters(), max_batch=4 * wave, tokens_per_block=4, draft=draft)
    lookup = {} if draft is not None else dict(prompt_lookup=2)
    params = SamplingParams(max_tokens=L, stop_at_eot=False, speculate=3, **lookup, **params)
    samples = []
    for _ in range(n // wave):
        requests = engine.submit([PROMPT], [params] * wave)
        engine.run_until_done()
        samples += [r.tokens[r.prompt_len:] for r in requests]
    assert_pool_is_whole(engine)
    return torch.tensor(samples), engine


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)],
                         ids=["t1", "t0.7-topk3"])
def test_sampling_keeps_the_models_distribution(small, sampling):
    """Both of the engine's draws: the batch's (temperature alone) and sample()'s (top-k)."""
    samples, engine = engine_samples(small, 8000, **sampling)
    assert chi_square_p_value(samples, exact_distribution(small, **sampling)) > 1e-4
    assert 0 < engine.accepted_tokens < engine.proposed_tokens  # both branches of the rule


def test_sampling_with_a_draft_keeps_the_models_distribution(small):
    """The draft's greedy proposals, checked as prompt lookup's are (q a point mass)."""
    draft = tiny_model(GPTConfig(context_len=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16), seed=42)
    samples, engine = engine_samples(small, 8000, draft=draft, temperature=1.0)
    assert chi_square_p_value(samples, exact_distribution(small, temperature=1.0)) > 1e-4
    assert 0 < engine.accepted_tokens < engine.proposed_tokens


def test_the_distribution_test_catches_a_wrong_rule_through_the_engine(small, monkeypatch):
    """Drawing from p after a rejection (not the residual): the same check fails it, so the
    engine's verification is the rule being tested, not something around it."""
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    samples, _ = engine_samples(small, 8000, temperature=1.0)
    assert chi_square_p_value(samples, exact_distribution(small, temperature=1.0)) < 1e-4


def test_a_grammar_sees_each_proposal_as_taken(model):
    """A regex constraint with speculation: each checked position is masked as if the
    proposals before it were taken (generation/structured.py's allowed_along): the tokens
    are the tokens without speculation."""
    pytest.importorskip("llguidance")
    params = dict(max_tokens=40, structured=("regex", r"(abc|abd)+e"), **GREEDY)
    texts = []
    for speculate in (0, 6):
        engine = Engine(model, TOKENIZER)
        request = engine.add_request([97, 98, 99] * 4, SamplingParams(speculate=speculate, **params))
        engine.run_until_done()
        texts.append(request.tokens[request.prompt_len:])
        assert_pool_is_whole(engine)
    assert texts[0] == texts[1] and engine.proposed_tokens > 0
