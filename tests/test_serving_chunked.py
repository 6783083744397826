"""Chunked prefill (serving/scheduler.py): a prompt fed a chunk a step, in a prefill pass
beside the decode pass, gives the tokens the same prompt gives prefilled whole, while the
streams already decoding get a token every step; a half-fed prompt's blocks join the prefix
index only once computed, and every block goes back when it is cancelled or preempted
halfway.

Token equality is exact, as in test_serving_engine.py: float32, a row computes the same
arithmetic in differently shaped matmuls (~1e-6 apart), and these seeds have no near-ties."""

import pytest

from base_model import GPTConfig
from conftest import assert_pool_is_whole, byte_tokenizer, random_prompts, run, tiny_model
from serving.engine import Engine, SamplingParams
from serving.scheduler import Scheduler

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
GREEDY = dict(temperature=0, stop_at_eot=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def engine_of(model, max_step_tokens, **kw):
    return Engine(model, TOKENIZER, tokens_per_block=8, max_batch=4,
                  max_step_tokens=max_step_tokens, **kw)


@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_chunked_prompts_give_the_tokens_of_whole_ones(model, attention):
    # max_step_tokens 9 and up to 4 decodes: chunks of 2 to 9 tokens, across block
    # boundaries; three requests at once share a prefill pass; 90 tokens go past the
    # context, so rows also reprefill (in chunks too)
    prompts = random_prompts([60, 3, 17, 41, 64, 9], seed=1)
    whole = run(engine_of(model, 0, attention=attention), prompts, max_tokens=90, **GREEDY)
    engine = engine_of(model, 9, attention=attention)
    assert run(engine, prompts, max_tokens=90, **GREEDY) == whole
    assert_pool_is_whole(engine)


def test_decoding_streams_get_a_token_every_step_while_a_prompt_is_fed(model):
    engine = engine_of(model, 12)
    streams = [engine.add_request(p, SamplingParams(max_tokens=40, **GREEDY))
               for p in random_prompts([4, 5, 6], seed=2)]
    while not all(s.tokens[s.prompt_len:] for s in streams):
        engine.step()  # the short prompts, 12 padded tokens a pass
    long = engine.add_request(random_prompts([60], seed=3)[0], SamplingParams(max_tokens=5, **GREEDY))
    steps = 0
    while not long.tokens[long.prompt_len:]:
        before = [len(s.tokens) for s in streams]
        engine.step()
        steps += 1
        assert [len(s.tokens) for s in streams] == [n + 1 for n in before]
    # 3 decodes a step leave 9 tokens of the budget: the 60-token prompt takes 7 steps,
    # its first token out of the seventh
    assert steps == 7 and long.cached_prompt_tokens == 0
    engine.run_until_done()
    assert_pool_is_whole(engine)


def test_a_half_fed_prompt_joins_the_prefix_index_only_where_computed(model):
    prompt = random_prompts([60], seed=4)[0]
    engine = engine_of(model, 20)
    first = engine.add_request(prompt, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()  # the first 20 tokens: 2 full blocks of 8 computed
    assert first.unfed and len(engine.pool.cached) == 2
    engine.run_until_done()
    assert len(engine.pool.cached) == 7  # 62 tokens: 7 full blocks, the prompt's and one generated
    again = engine.add_request(prompt, SamplingParams(max_tokens=3, **GREEDY))
    engine.run_until_done()
    assert again.cached_prompt_tokens == 56 and again.tokens == first.tokens
    assert_pool_is_whole(engine)


def test_a_cancelled_half_fed_prompt_frees_its_blocks(model):
    engine = engine_of(model, 10)
    requests = [engine.add_request(p, SamplingParams(max_tokens=30, **GREEDY))
                for p in random_prompts([5, 50], seed=5)]
    for _ in range(3):
        engine.step()
    assert requests[1].unfed and not requests[0].unfed
    engine.cancel(requests[1])
    engine.step()
    assert requests[1].finish_reason == "cancelled" and requests[1].tokens == random_prompts([5, 50], seed=5)[1]
    engine.run_until_done()
    assert requests[0].finish_reason == "length"
    assert_pool_is_whole(engine)


def test_a_prompt_preempted_halfway_is_fed_again_and_gives_the_same_tokens(model, monkeypatch):
    preempted_halfway = []
    preempt = Scheduler.preempt

    def record(scheduler, seq):
        preempted_halfway.append(bool(seq.unfed))
        preempt(scheduler, seq)
    monkeypatch.setattr(Scheduler, "preempt", record)
    # 9 blocks of 8: 2 for each stream (10 tokens), then 5 for the 40-token prompt, fed 6
    # tokens a step (8 less 2 decodes); the streams need a third block within 6 steps, and
    # the prompt is the newest
    prompts = random_prompts([10, 10, 40], seed=6)

    def serve(engine):
        streams = [engine.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in prompts[:2]]
        while not all(s.tokens[s.prompt_len:] for s in streams):
            engine.step()
        long = engine.add_request(prompts[2], SamplingParams(max_tokens=40, **GREEDY))
        engine.run_until_done()
        assert_pool_is_whole(engine)
        return [r.tokens for r in streams + [long]]
    assert serve(engine_of(model, 8, num_blocks=9)) == serve(engine_of(model, 0, num_blocks=9))
    assert any(preempted_halfway)  # at least one preemption hit a prompt between its chunks


def test_seeds_and_scored_prompts_are_unchanged_by_chunks(model):
    """A seeded request's generator does not move while its prompt is fed in part, so it
    draws the tokens it draws unchunked; a prompt whose logprobs are asked is fed whole
    (its every position's logits come from one pass): the same logprobs within 1e-5
    (float32, other rows beside it in the pass: ~1e-6 apart)."""
    prompts = random_prompts([50, 45, 7], seed=7)
    settings = [dict(temperature=0.9, top_k=20, seed=1), dict(temperature=0, prompt_logprobs=2),
                dict(temperature=1.2, seed=5)]

    def serve(max_step_tokens):
        engine = engine_of(model, max_step_tokens)
        requests = [engine.add_request(p, SamplingParams(max_tokens=20, stop_at_eot=False, **s))
                    for p, s in zip(prompts, settings)]
        engine.run_until_done()
        assert_pool_is_whole(engine)
        return requests
    chunked, whole = serve(8), serve(0)
    assert [r.tokens for r in chunked] == [r.tokens for r in whole]
    scored = list(zip(chunked[1].prompt_logprobs[1:], whole[1].prompt_logprobs[1:]))
    assert len(scored) == 44
    for a, b in scored:
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_budget_without_room_for_a_chunk_is_refused(model):
    with pytest.raises(ValueError, match="max_step_tokens must be 0"):
        engine_of(model, 4)  # max_batch 4 decodes would leave nothing
