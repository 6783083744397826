"""A request decoding alone goes through the compiled step (serving/lone_step.py), and
nothing it does differs from the engine's own step: the same tokens as the generation
loop gives the prompt alone, whoever joins or leaves the batch meanwhile, the pool holding
every column it wrote (a later request's prefix hits on them give the same tokens), the
same log-probabilities and seeded samples.

The `builds` fixture runs the exported graph in Python instead of the C++ library
(tests/test_compiled.py builds a real one): the step's logic, not the compiler, is what
these tests check. Token equality is exact for greedy decoding: the graph computes the
eager arithmetic in another order (~1e-6 apart), and argmax flips only at near-ties, which
these seeds lack."""

from pathlib import Path

import pytest
import torch

from base_model import GPTConfig
from conftest import run, tiny_model
from serving.background_build import BackgroundBuild
from serving.engine import Engine, SamplingParams
from serving.model_runner import IF_CACHED
from test_serving_engine import CONFIG, GREEDY, TOKENIZER, alone, random_prompts  # the engine tests'


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def prompt_of(n, seed=0):
    return random_prompts([n], seed)[0]


def generated(request):
    return request.tokens[request.prompt_len:]


def both_ways(model, prompt, n, watch=None):
    """A greedy request of n tokens with log-probabilities, through an engine without the
    lone step, then one with it: (the second request, each run's log-probabilities, the
    second engine). watch(engine), if given, is called after each of the second's steps."""
    runs = []
    for compile in (False, True):
        engine = Engine(model, TOKENIZER, tokens_per_block=8, compile=compile)
        outputs = []
        request = engine.add_request(prompt, SamplingParams(max_tokens=n, logprobs=0, **GREEDY),
                                     lambda request, output: outputs.append(output))
        while engine.has_work():
            engine.step()
            if compile and watch is not None:
                watch(engine)
        runs.append([o.logprob.logprob for o in outputs])
    return request, runs, engine


def pool_columns(engine, request):
    """The request's cached keys and values as the pool holds them: (n_layer, 2, positions, nh, hd)."""
    tpb = engine.pool.tokens_per_block
    slots = [request.blocks[p // tpb] * tpb + p % tpb for p in range(request.num_cached)]
    return engine.pool.kv[:, :, slots]


def test_a_lone_request_decodes_through_the_compiled_step(model, builds):
    # 150 tokens: past the context (64) three times, so the request is re-prefilled and the
    # lone step must reload its cache from the pool at new positions. Its log-probabilities
    # equal the engine's own step's within 1e-5 (the graph computes the same arithmetic in
    # another order, ~1e-6 apart): a stale or missing cache column would move them more
    prompt = prompt_of(5)
    request, (plain, lone), engine = both_ways(model, prompt, 150)
    assert len(builds) == 1  # built once, with the engine
    assert generated(request) == alone(model, prompt, 150, temperature=0)
    # the prompt, then a reprefill (to 32 tokens) at 65, 98 and 131 tokens: the last two find
    # their whole window in the prefix cache (greedy decoding of this random model repeats
    # itself), and a pass feeding only the found window's last token is the lone step's too
    assert engine.scheduler.cached_tokens == 2 * 31  # found, but the last token is computed again
    prefills = 2
    assert engine.runner.lone_steps == 150 - prefills
    assert lone == pytest.approx(plain, abs=1e-5)
    assert len(engine.pool.free) == engine.pool.num_blocks


def test_the_lone_steps_cache_grows_with_the_request(builds):
    # the dense cache is sized to the request (CACHE_GROWTH columns at a time) and gathered again
    # from the pool into a larger one when outgrown: 64, 128, then the context's 160. The
    # same tokens as the prompt alone, and log-probabilities within 1e-5 of the engine
    # without the lone step (the graph's arithmetic in another order, ~1e-6 apart): a
    # column lost in a regrowth would move them more
    config = GPTConfig(context_len=160, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
    model = tiny_model(config, seed=8)
    prompt = prompt_of(5, seed=6)
    sizes = set()

    def note_size(engine):  # the dense cache's columns while it holds the request
        if engine.runner.lone.holds is not None:
            sizes.add(engine.runner.lone.cache.max_len)
    request, (plain, lone), engine = both_ways(model, prompt, 150, note_size)
    assert sizes == {64, 128, 160} and engine.runner.lone_steps == 149
    assert generated(request) == alone(model, prompt, 150, temperature=0)
    assert lone == pytest.approx(plain, abs=1e-5)


def test_a_lone_request_that_samples_is_drawn_not_handed_the_greedy_token(model, builds):
    # the lone step hands back its greedy pick beside the logits; only a greedy request may
    # take it. Each token the lone step made (all but the prefill's) is compared with the
    # greedy pick for its own context: this random model is near-uniform over 260 tokens,
    # so at temperature 2 a draw seldom lands on it, where taking the pick would match all
    # 29 (tried: 29)
    prompt = prompt_of(6, seed=4)
    engine = Engine(model, TOKENIZER, compile=True)
    request = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=2.0, stop_at_eot=False),
                                 lambda request, output: None)
    engine.run_until_done()
    assert engine.runner.lone_steps == 29
    with torch.no_grad():
        logits = model(torch.tensor([request.tokens[:-1]]))[0][0, :, :TOKENIZER.n_vocab]  # (T - 1, V)
    picks = logits.argmax(-1)[len(prompt):].tolist()  # the greedy pick after each context
    lone_tokens = generated(request)[1:]
    assert sum(p == t for p, t in zip(picks, lone_tokens)) < 10


def test_requests_joining_and_leaving_a_lone_one_change_nothing(model, builds):
    first, second = prompt_of(7, seed=1), prompt_of(12, seed=2)
    engines = [Engine(model, TOKENIZER, tokens_per_block=8, compile=c) for c in (False, True)]
    plain, engine = engines
    logprobs = {plain: [], engine: []}  # of a's tokens
    a, plain_a = (e.add_request(first, SamplingParams(max_tokens=40, logprobs=0, **GREEDY),
                                lambda request, output, e=e: logprobs[e].append(output.logprob.logprob))
                  for e in (engine, plain))
    for _ in range(10):  # the prefill, then 9 tokens alone
        engine.step(), plain.step()
    assert engine.runner.lone_steps == 9
    # every column the lone step wrote is in the pool, as the engine's own step writes it
    # (1e-5: the same arithmetic in another order)
    torch.testing.assert_close(pool_columns(engine, a), pool_columns(plain, plain_a), rtol=0, atol=1e-5)
    b = engine.add_request(second, SamplingParams(max_tokens=12, **GREEDY))
    # b's prefill beside a's decode pass (a alone in it: one more lone step), then 11 steps
    # decoding both: no lone step
    for _ in range(12):
        engine.step()
    assert engine.runner.lone_steps == 10 and b.finish_reason == "length"
    engine.run_until_done()  # a alone again: its cache reloaded from the pool
    plain.run_until_done()
    assert engine.runner.lone_steps == 10 + (40 - 1 - 10 - 11)
    assert generated(a) == alone(model, first, 40, temperature=0)
    assert generated(b) == alone(model, second, 12, temperature=0)
    assert logprobs[engine] == pytest.approx(logprobs[plain], abs=1e-5)


def test_columns_the_lone_step_wrote_serve_prefix_hits(model, builds):
    engine = Engine(model, TOKENIZER, tokens_per_block=8, compile=True)
    prompt = prompt_of(5, seed=4)
    a = engine.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    engine.run_until_done()
    # a second request sending a's text back: every full block of it is found in the pool,
    # most of them written by the lone step
    text = a.tokens
    b = engine.add_request(text, SamplingParams(max_tokens=10, **GREEDY))
    engine.run_until_done()
    assert engine.scheduler.cached_tokens == len(text) // 8 * 8
    assert generated(b) == alone(model, text, 10, temperature=0)


def test_a_prompt_found_whole_in_the_prefix_cache_goes_through_the_lone_step(model, builds):
    # the second request's 16 tokens are two full blocks of the first's: all cached, its
    # last token is fed again for its logits. That pass is the lone step's too (else a batch
    # of one is a graph of its own for the batch step: a build stalling the server), and it
    # leaves the shared blocks as they were
    engine = Engine(model, TOKENIZER, tokens_per_block=8, compile=True)
    prompt = prompt_of(16, seed=8)
    engine.add_request(prompt, SamplingParams(max_tokens=5, **GREEDY))
    engine.run_until_done()
    steps_before = engine.runner.lone_steps  # the first request's 4 decode steps
    b = engine.add_request(prompt, SamplingParams(max_tokens=5, **GREEDY))
    before = engine.pool.kv.clone()
    engine.step()  # b's first pass: its whole prompt was found
    tpb = engine.pool.tokens_per_block
    slots = [b.blocks[p // tpb] * tpb + p % tpb for p in range(16)]
    engine.run_until_done()
    assert engine.scheduler.cached_tokens == 15  # found; the last token is computed again
    assert engine.runner.lone_steps == steps_before + 5  # the found prompt's pass, then 4 decode steps
    assert generated(b) == alone(model, prompt, 5, temperature=0)
    assert torch.equal(engine.pool.kv[:, :, slots], before[:, :, slots])


def test_log_probabilities_and_seeded_samples_as_the_engines_own_step(model, builds):
    # tolerance 1e-5: the compiled graph and the paged step compute the same logits in a
    # different order (float32 rounding, ~1e-6)
    params = [SamplingParams(max_tokens=20, logprobs=3, stop_at_eot=False, **kw)
              for kw in (dict(temperature=0), dict(temperature=0.8, top_k=50, seed=7))]
    prompt = prompt_of(9, seed=5)
    results = []
    for compile in (False, True):
        engine = Engine(model, TOKENIZER, compile=compile)
        outputs = {p: [] for p in params}
        for p in params:  # one at a time, so each decodes alone
            engine.add_request(prompt, p, lambda request, out: outputs[request.params].append(out))
            engine.run_until_done()
        assert engine.runner.lone_steps == (2 * 19 if compile else 0)
        results.append(outputs)
    for p in params:
        plain, lone = results[0][p], results[1][p]
        assert [o.token for o in lone] == [o.token for o in plain]
        for x, y in zip(plain, lone):
            assert y.logprob.logprob == pytest.approx(x.logprob.logprob, abs=1e-5)
            assert [t for t, _ in y.logprob.top] == [t for t, _ in x.logprob.top]


def test_a_lone_request_never_reads_the_previous_ones_cache(model, builds):
    # x leaves the dense cache holding 5 + 10 - 1 = 14 columns; y's first decoded token is
    # at column 14 too, but none of x's columns are y's
    x, y = prompt_of(5, seed=6), prompt_of(14, seed=7)
    logprobs = []
    for compile in (False, True):
        engine = Engine(model, TOKENIZER, compile=compile)
        engine.add_request(x, SamplingParams(max_tokens=10, **GREEDY))
        engine.run_until_done()
        outputs = []
        engine.add_request(y, SamplingParams(max_tokens=10, logprobs=0, **GREEDY),
                           lambda request, output: outputs.append(output.logprob.logprob))
        engine.run_until_done()
        logprobs.append(outputs)
    assert engine.runner.lone_steps == 2 * 9
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-5)


def test_a_lone_client_of_the_server_is_served_by_the_compiled_step(model, builds):
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from serving.server import BackgroundServer
    engine = Engine(model, TOKENIZER, tokens_per_block=8, compile=True)
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, "tiny") as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            prompt = "ROMEO: "
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                               temperature=0, stream=True)
            text = "".join(chunk.choices[0].text for chunk in stream)
    finally:
        engine.stop()
    ids = TOKENIZER.encode_ordinary(prompt)
    assert text == TOKENIZER.decode(alone(model, ids, 20, temperature=0))
    assert engine.runner.lone_steps == 19


def test_if_cached_the_lone_step_is_taken_only_once_a_compile_start_built_it(builds):
    # serve.py's default (IF_CACHED): no build at start; the engine's batch step for a lone
    # request, until a start with compile has built (cached) the lone step, then that step,
    # with the same tokens; the batch's step never frozen (that is --compile's alone). Each
    # engine a model of its own, as each start of serve.py has (a model keeps its last step)
    def start(compile):
        return Engine(tiny_model(CONFIG, seed=3), TOKENIZER, tokens_per_block=8, compile=compile)
    prompt = prompt_of(7, seed=9)
    before = start(IF_CACHED)
    assert before.runner.lone is None and not builds and not before.runner.frozen
    start(True)  # builds it
    after = start(IF_CACHED)
    assert after.runner.lone is not None and len(builds) == 2 and not after.runner.frozen
    model = after.model
    tokens = [run(engine, [prompt], max_tokens=20, **GREEDY)[0] for engine in (before, after)]
    assert before.runner.lone_steps == 0 and after.runner.lone_steps == 19
    assert tokens[0] == tokens[1] == alone(model, prompt, 20, temperature=0)


class FakeBuild:
    """serving/background_build.py's BackgroundBuild as the runner sees it: finished() is
    None while building, then its outcome once, then None."""
    def __init__(self):
        self.outcome, self.asked = None, 0

    def finished(self):
        self.asked += 1
        outcome, self.outcome = self.outcome, None
        return outcome


@pytest.mark.parametrize("succeeds", [True, False])
def test_a_background_build_is_taken_up_by_the_next_lone_request(builds, succeeds):
    # serve.py's default with nothing cached: the batch step while the child builds; once it
    # has built (cached) the step, the next lone request takes it, with the same tokens; a
    # build that failed leaves the batch step, asked no more
    engine = Engine(tiny_model(CONFIG, seed=3), TOKENIZER, tokens_per_block=8, compile=IF_CACHED)
    build = engine.runner.lone_build = FakeBuild()
    prompt = prompt_of(7, seed=9)
    while_building = run(engine, [prompt], max_tokens=10, **GREEDY)[0]
    assert engine.runner.lone is None and engine.runner.lone_steps == 0 and build.asked == 9
    if succeeds:
        Engine(tiny_model(CONFIG, seed=3), TOKENIZER, tokens_per_block=8, compile=True)  # the child's build
    build.outcome = succeeds
    after = run(engine, [prompt], max_tokens=10, **GREEDY)[0]
    assert (engine.runner.lone is not None) == succeeds and engine.runner.lone_build is None
    assert engine.runner.lone_steps == (9 if succeeds else 0) and build.asked == 10
    assert while_building == after == alone(engine.model, prompt, 10, temperature=0)


@pytest.mark.parametrize("status", [0, 3])
def test_the_background_build_says_once_how_it_ended(tmp_path, status):
    # the child is serve.py with its arguments and --compile --build-only (a stand-in script
    # here, which records them): finished() is None while it runs, then its outcome once,
    # with one line; its log is removed where it succeeded, named where it failed
    script = tmp_path / "serve.py"
    script.write_text(f"import sys, time\ntime.sleep(0.5)\nprint(sys.argv[1:])\nsys.exit({status})\n")
    said = []
    build = BackgroundBuild(script, ["--ckpt", "x.pt"], report=said.append)
    assert build.finished() is None and said == []
    build.process.wait()
    log = Path(build.log.name)
    assert build.finished() is (status == 0) and build.finished() is None and len(said) == 1
    if status == 0:
        assert "built in the background" in said[0] and not log.exists()
    else:
        assert f"exit status {status}" in said[0] and str(log) in said[0]
        assert "'--ckpt', 'x.pt', '--compile', '--build-only', '--max-batch', '1'" in log.read_text()
        log.unlink()


def test_the_background_build_ends_with_the_server(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text("import time\ntime.sleep(60)\n")
    build = BackgroundBuild(script, [], report=lambda line: None)
    process, log = build.process, Path(build.log.name)
    build.stop()
    assert process.poll() is not None and not log.exists() and build.finished() is None


def test_with_compile_the_batch_step_has_the_weights_frozen_in_and_the_same_tokens(builds):
    # Engine(compile=True) also compiles the batched decode step with freezing and
    # max_autotune (paged_attention.py): inductor lays every Linear's weight out for oneDNN
    # and times that against its own template; its paged kernel is the hand-written one
    # (paged_attention.cpp). A model of its own: the frozen graph is compiled for it here,
    # and its weights are constants in it.
    from torch._dynamo.utils import counters
    model = tiny_model(CONFIG, seed=5)
    prompts = [prompt_of(6, seed=6), prompt_of(11, seed=7)]
    counters["inductor"].clear()
    engines = [Engine(model, TOKENIZER, tokens_per_block=8, compile=c) for c in (False, True)]
    requests = {e: [e.add_request(p, SamplingParams(max_tokens=20, **GREEDY)) for p in prompts] for e in engines}
    engines[0].run_until_done()
    with torch.profiler.profile() as profile:  # the operations the frozen step calls
        engines[1].run_until_done()
    plain, frozen = (requests[e] for e in engines)
    assert any(event.name == "kvcache_gpt::decode_attention" for event in profile.events())
    # the 4 Linears of each of the 2 blocks and the lm_head: 9 weights packed in the graph
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] >= 9
    for p, f, prompt in zip(plain, frozen, prompts):
        assert generated(f) == generated(p) == alone(model, prompt, 20, temperature=0)


def test_with_compile_short_prefills_go_through_the_compiled_step_as_rows(model, builds):
    # a prefix hit's last tokens, and two short prompts admitted together, are fed as rows
    # of the compiled step (decode_index.fed_rows); a long prompt (more tokens than
    # max_batch) is still the eager pass's. Every token's log-probability as the engine
    # without compile gives it, within 1e-5 (the same arithmetic in another order): a row
    # reading a wrong column moves them by ~1e-2 (tried: every row's key written nowhere),
    # where this near-uniform random model's greedy tokens hardly move at all
    prefix = prompt_of(24, seed=9)
    prompts = [prefix + [5, 6], prefix + [7, 8, 9], prompt_of(5, seed=10), prompt_of(9, seed=11)]
    runs = []
    for compile in (False, True):
        engine = Engine(model, TOKENIZER, tokens_per_block=8, max_batch=16, compile=compile)
        outputs = {}
        passes = []
        for group in ([prompts[0]], [prompts[1]], prompts[2:]):  # the pair is admitted together
            for prompt in group:
                engine.add_request(prompt, SamplingParams(max_tokens=6, logprobs=0, **GREEDY),
                                   lambda request, out: outputs.setdefault(request.prompt_len, []).append(out))
            engine.run_until_done()
            passes.append(engine.runner.compiled_prefills)
        runs.append(outputs)
    assert passes == [0, 1, 2]  # the long prompt eagerly; the hit; the pair in one pass
    assert engine.scheduler.cached_tokens == 24
    plain, rows = runs
    assert sorted(plain) == sorted(rows) == sorted(len(p) for p in prompts)
    for length in plain:
        assert [o.token for o in rows[length]] == [o.token for o in plain[length]]
        assert [o.logprob.logprob for o in rows[length]] == pytest.approx(
            [o.logprob.logprob for o in plain[length]], abs=1e-5)
