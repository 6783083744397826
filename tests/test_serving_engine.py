"""The serving engine (serving/): every request's tokens equal the same prompt generated
alone by the generation loop, whatever runs beside it (different prompts, shared prefixes,
preemption in a pool too small for the batch, reprefill past the context), and every
block goes back to the pool.

Token equality is exact: a row computes the same arithmetic as alone in differently
shaped matmuls (~1e-6 apart, see test_batch.py), and greedy argmax flips only at
near-ties, which these seeds lack."""

import threading
import time

import pytest
import torch

from base_model import GPTConfig
from conftest import assert_pool_is_whole, byte_tokenizer, random_prompts, run, tiny_model
from generation.loop import generate_tokens
from serving.engine import Engine, SamplingParams
from serving.paged_cache import BlockPool, default_num_blocks

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
GREEDY = dict(temperature=0, stop_at_eot=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def alone(model, prompt, n, **kw):
    """What the generation loop gives the prompt by itself."""
    return generate_tokens(model, [prompt], n, vocab_limit=TOKENIZER.n_vocab, **kw)[0].tolist()


@pytest.mark.parametrize("tokens_per_block, attention", [(1, "kernel"), (8, "kernel"),
                                                         (16, "kernel"), (8, "gather")])
def test_concurrent_prompts_equal_each_alone(model, tokens_per_block, attention):
    # lengths across block boundaries, one at the full context; 150 new tokens go past
    # context_len (64), so every row also reprefills, each at its own step. Both ways of
    # reading the pages: the compiled paged kernel and the gather
    prompts = random_prompts([1, 5, 16, 17, 33, 64, 40])
    engine = Engine(model, TOKENIZER, tokens_per_block=tokens_per_block, max_batch=4,
                    attention=attention)
    rows = run(engine, prompts, max_tokens=150, **GREEDY)
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 150, temperature=0)
    assert_pool_is_whole(engine)


def test_shared_prefixes_are_not_recomputed_and_change_nothing(model):
    base = random_prompts([40], seed=1)[0]
    prompts = [base[:33] + tail for tail in random_prompts([1, 6, 20], seed=2)]
    prompts += [base[:32], base]  # a prompt that is only whole cached blocks; the whole base
    engine = Engine(model, TOKENIZER, tokens_per_block=8)
    first = run(engine, [base], max_tokens=10, **GREEDY)  # fills the prefix index
    rows = run(engine, prompts, max_tokens=10, **GREEDY)
    # 4 full blocks (32 tokens) of base are found by each later prompt; a prompt found
    # whole (base[:32], and base: its 5th block is full too) feeds its last token again,
    # for its logits
    assert engine.scheduler.cached_tokens == 32 * 3 + 31 + 39
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 10, temperature=0)
    assert rows[-1] == first[0]
    assert_pool_is_whole(engine)


def test_samples_of_one_prompt_admitted_together_share_its_blocks(model):
    prompt = random_prompts([48], seed=3)[0]
    engine = Engine(model, TOKENIZER, tokens_per_block=8)
    rows = run(engine, [prompt] * 4, max_tokens=5, **GREEDY)
    assert rows == [alone(model, prompt, 5, temperature=0)] * 4
    # 6 shared prompt blocks + one block each for the new tokens, not 4 x 7
    assert engine.peak_blocks == 6 + 4
    assert engine.scheduler.cached_tokens == 3 * 47


def test_a_pool_too_small_for_the_batch_preempts_and_recomputes(model):
    prompts = random_prompts([3, 30, 12, 50, 7, 25], seed=4)
    engine = Engine(model, TOKENIZER, num_blocks=8, tokens_per_block=8, max_batch=6)
    rows = run(engine, prompts, max_tokens=100, **GREEDY)
    assert engine.scheduler.preemptions > 0
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 100, temperature=0)
    assert engine.peak_blocks <= 8
    assert_pool_is_whole(engine)


def test_each_request_keeps_its_own_sampling_and_seed(model):
    prompts = random_prompts([4, 9, 20], seed=5)
    settings = [dict(temperature=0.9, top_k=20, seed=1), dict(temperature=1.3, top_p=0.8, seed=2),
                dict(temperature=0)]
    engine = Engine(model, TOKENIZER)
    requests = [engine.add_request(p, SamplingParams(max_tokens=40, stop_at_eot=False, **s))
                for p, s in zip(prompts, settings)]
    engine.run_until_done()
    for prompt, s, r in zip(prompts, settings, requests):
        seed = s.pop("seed", None)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        assert r.tokens[r.prompt_len:] == alone(model, prompt, 40, generator=generator, **s)


def test_stop_strings_end_text_and_free_blocks(model):
    engine = Engine(model, TOKENIZER, tokens_per_block=4)
    prompt = random_prompts([10], seed=6)[0]
    whole = engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY))
    engine.run_until_done()
    text = whole.text.text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle
    outputs = []
    request = engine.add_request(prompt, SamplingParams(max_tokens=40, stop=(stop,), **GREEDY),
                                 lambda r, out: outputs.append(out))
    engine.run_until_done()
    assert request.finish_reason == "stop" and outputs[-1].finish_reason == "stop"
    assert request.text.text == text[:text.index(stop)]
    assert "".join(o.text for o in outputs) == request.text.text
    assert_pool_is_whole(engine)


def test_cancelled_requests_free_their_blocks(model):
    engine = Engine(model, TOKENIZER, tokens_per_block=4)
    requests = [engine.add_request(p, SamplingParams(max_tokens=50, **GREEDY))
                for p in random_prompts([10, 30, 3], seed=7)]
    for _ in range(5):
        engine.step()
    assert len(engine.pool.free) < engine.pool.num_blocks
    for r in requests:
        engine.cancel(r)
    engine.step()
    assert [r.finish_reason for r in requests] == ["cancelled"] * 3
    assert_pool_is_whole(engine)


def test_run_serves_requests_from_other_threads_until_stopped(model):
    """serve.py's arrangement: the engine runs on the thread that loaded the model, the
    requests come from another (the HTTP server's), and stop() ends run()."""
    engine = Engine(model, TOKENIZER)
    prompts = random_prompts([5, 6, 7], seed=8)
    finished = []

    def on_output(request, output):
        if output.finish_reason:
            finished.append(request)
            if len(finished) == len(prompts):
                engine.stop()  # from the engine's own thread, inside run()

    def client():
        for p in prompts:
            time.sleep(0.01)  # run() is waiting for work when the first one arrives
            engine.add_request(p, SamplingParams(max_tokens=10, **GREEDY), on_output)
    thread = threading.Thread(target=client)
    thread.start()
    engine.run()
    thread.join()
    assert len(finished) == len(prompts)
    for r in finished:
        assert r.tokens[r.prompt_len:] == alone(model, r.tokens[:r.prompt_len], 10, temperature=0)
    assert_pool_is_whole(engine)
    engine.stop()  # a stop before run() ends it at once
    engine.run()


def test_a_failed_step_ends_what_was_in_flight_and_the_engine_goes_on(model, monkeypatch):
    engine = Engine(model, TOKENIZER)
    engine.start()
    try:
        broken = threading.Event()
        real_forward = engine.runner.forward

        def forward_once_broken(batch):
            if not broken.is_set():
                broken.set()
                raise RuntimeError("out of memory (simulated)")
            return real_forward(batch)
        monkeypatch.setattr(engine.runner, "forward", forward_once_broken)
        ended = threading.Event()
        first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, **GREEDY),
                                   lambda r, out: out.finish_reason and ended.set())
        assert ended.wait(timeout=60)
        assert first.finish_reason == "error" and "simulated" in first.error
        ended.clear()
        second = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, **GREEDY),
                                    lambda r, out: out.finish_reason and ended.set())
        assert ended.wait(timeout=60) and second.finish_reason == "length"
    finally:
        engine.stop()
    assert_pool_is_whole(engine)


@pytest.mark.parametrize("max_batch", [4, 64])
def test_warm_up_runs_every_decode_width_the_compiled_step_splits_on(model, monkeypatch, max_batch):
    """A compiled step is a graph for one sequence, one for a few and, over DenseLinears,
    one past MATVEC_ROWS rows (our kernel's limit): warm_up decodes each width, so that no
    request pays for a compile (with max_batch 4 no pass is that wide)."""
    from generation.dense_matmul import MATVEC_ROWS
    engine = Engine(model, TOKENIZER, max_batch=max_batch)
    widths = []
    real_forward = engine.runner.forward

    def forward_counted(batch):
        if all(s.num_fed == 1 for s in batch):  # a decode pass: a row per sequence
            widths.append(len(batch))
        return real_forward(batch)
    monkeypatch.setattr(engine.runner, "forward", forward_counted)
    engine.warm_up()
    assert sorted(set(widths)) == ([1, 2, 4] if max_batch == 4 else [1, 2, MATVEC_ROWS + 1])
    assert_pool_is_whole(engine)


def test_bad_requests_are_refused_before_they_queue(model):
    engine = Engine(model, TOKENIZER)
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        engine.add_request(list(range(65)), SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1], SamplingParams(top_p=0))
    assert not engine.has_work()


def direct_logprobs(model, tokens):
    """log_softmax of one plain forward over the whole sequence: (len - 1, V), row i the
    distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0][0, :-1, :TOKENIZER.n_vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_equal_a_direct_forward_with_prefix_caching(model):
    """Prompt and generated tokens' log-probabilities, scored while other requests run and
    with the prompt's first blocks already cached, equal one plain forward of the model
    within 1e-5 (float32; the same arithmetic in differently shaped matmuls differs by
    ~1e-6). A scored prompt is fed whole (its cached keys read, not recomputed): the
    prefix cache spares it nothing but memory."""
    base = random_prompts([40], seed=9)[0]
    engine = Engine(model, TOKENIZER, tokens_per_block=8)
    run(engine, [base[:24]], max_tokens=3, **GREEDY)  # caches base's first 3 blocks
    prompts = [base, base[:30] + [7, 8, 9], [5]]
    scored = [engine.add_request(p, SamplingParams(max_tokens=0, prompt_logprobs=3, **GREEDY))
              for p in prompts]
    generated = []
    generating = engine.add_request(base[:26], SamplingParams(max_tokens=12, logprobs=2,
                                                              prompt_logprobs=0, **GREEDY),
                                    lambda r, out: generated.append(out.logprob))
    bystander = engine.add_request(base[:25], SamplingParams(max_tokens=5, **GREEDY))
    engine.run_until_done()
    for p, r in zip(prompts, scored):
        assert r.finish_reason == "length" and r.tokens == p and r.cached_prompt_tokens == 0
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
        direct = direct_logprobs(model, p)
        for i, lp in enumerate(r.prompt_logprobs[1:]):
            assert lp.token == p[i + 1]
            assert abs(lp.logprob - direct[i, p[i + 1]].item()) < 1e-5
            values, ids = direct[i].topk(3)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(lp.top, values.tolist())) < 1e-5
    assert bystander.cached_prompt_tokens == 24  # an unscored request still skips them
    outputs = generating.tokens
    direct = direct_logprobs(model, outputs)
    assert [g.token for g in generated] == outputs[26:]
    for i, g in enumerate(generated, start=25):
        assert abs(g.logprob - direct[i, outputs[i + 1]].item()) < 1e-5
        assert g.top[0][0] == g.token and len(g.top) == 2  # greedy: the likeliest token
    assert [lp.top for lp in generating.prompt_logprobs[1:]] == [[]] * 25
    assert_pool_is_whole(engine)


def test_stop_token_ids_end_the_text_even_past_the_end_of_text_token(model):
    prompt = random_prompts([6], seed=10)[0]
    whole = alone(model, prompt, 20, temperature=0)
    stop = whole[8]
    engine = Engine(model, TOKENIZER)
    r = engine.add_request(prompt, SamplingParams(max_tokens=20, stop_token_ids=(stop,), **GREEDY))
    engine.run_until_done()
    assert r.finish_reason == "stop" and r.tokens[6:] == whole[:whole.index(stop) + 1]
    assert r.text.text == TOKENIZER.decode(whole[:whole.index(stop)])  # not the stop token
    assert_pool_is_whole(engine)


def test_prefix_hashes_cover_everything_before_a_block():
    pool = BlockPool(CONFIG, num_blocks=16, tokens_per_block=4)
    a = pool.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = pool.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # the partial block has no hash
    assert a[1] != b[1]  # same tokens 5..8, different block before them: not the same block
    assert pool.block_hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a


def test_unused_cached_blocks_are_evicted_oldest_first():
    pool = BlockPool(CONFIG, num_blocks=16, tokens_per_block=4)

    def allocate(tokens):
        return pool.allocate(len(tokens), pool.block_hashes(tokens))
    first, _, _ = allocate(list(range(64)))  # all 16 blocks
    pool.release(first)
    assert allocate(list(range(64)))[2] == 64  # freed, but still cached: a full hit
    pool.release(first)
    fresh, _, cached = allocate(list(range(100, 104)))
    assert cached == 0 and fresh == [first[-1]]  # the last block, freed first, goes first
    pool.release(fresh)
    assert allocate(list(range(64)))[2] == 60  # its 15 blocks before it still hit


def test_the_default_pool_holds_max_batch_full_contexts_up_to_1_gib():
    assert default_num_blocks(CONFIG, 8, max_batch=4, kv_dtype="float32") == 4 * 64 // 8
    gpt2 = GPTConfig(context_len=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)
    blocks = default_num_blocks(gpt2, 16, max_batch=64, kv_dtype="float32")
    block_bytes = 12 * 2 * 16 * 768 * 4  # layers x (k, v) x positions x width x fp32
    assert blocks * block_bytes <= 2**30 < (blocks + 1) * block_bytes  # 64 contexts: 4.5 GiB
    # never less than one full context, whatever the cap: a block of this shape is 151 MB
    huge = GPTConfig(context_len=1024, vocab_size=50257, n_layer=96, n_head=96, n_embd=12288)
    assert default_num_blocks(huge, 16, max_batch=64, kv_dtype="float32") == 1024 // 16
