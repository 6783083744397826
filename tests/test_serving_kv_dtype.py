"""A quantized paged pool (serve.py --kv-dtype; serving/paged_cache.py with kv_quant.py's
formats): its bytes are the formula memory_plan.py prints; the engine's greedy text equals
the generation loop's with the same kv dtype, alone, beside others, with prefixes shared and
with preemption; prompt log-probabilities equal a forward through a preallocated cache of
that dtype; /health and /metrics report the pool; every block goes back.

Equality is exact for tokens: a key is quantized once, when it is written, from values that
differ from the loop's by ~1e-6 (differently shaped matmuls, test_batch.py), which moves a
code only when it lies within ~1e-6 of a rounding boundary: none does at these seeds, and a
flipped code would still change a greedy token only at a near-tie. Log-probabilities:
within 1e-5, as the float pool's (test_serving_engine.py), for the same reason."""

import json
import urllib.request

import pytest
import torch

from base_model import GPTConfig
from conftest import assert_pool_is_whole, byte_tokenizer, random_prompts, run, tiny_model
from generation.loop import generate_tokens
from kv_cache import KVCache
from kv_quant import KV_DTYPES, cache_bytes, head_bytes
from memory_plan import shape_of, windowed_cache_bytes
from serving.engine import Engine, SamplingParams
from serving.paged_cache import BlockPool, default_num_blocks

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
GREEDY = dict(temperature=0, stop_at_eot=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def alone(model, prompt, n, kv_dtype):
    """The generation loop's greedy tokens for the prompt by itself, its cache stored as kv_dtype."""
    return generate_tokens(model, [prompt], n, vocab_limit=TOKENIZER.n_vocab, temperature=0,
                           cache_kind=kv_dtype)[0].tolist()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_pools_bytes_are_the_formula_memory_plan_prints(kv_dtype):
    pool = BlockPool(CONFIG, num_blocks=20, tokens_per_block=8, kv_dtype=kv_dtype)
    slots = 21 * 8  # + the null block
    assert pool.nbytes() == cache_bytes(CONFIG, slots, 1, kv_dtype)
    per_token = windowed_cache_bytes(shape_of("tiny", CONFIG), kv_dtype, 1000) // 1000
    assert pool.nbytes() == slots * per_token
    assert pool.block_bytes() == 8 * per_token == 8 * 2 * CONFIG.n_layer * CONFIG.n_kv_head * \
        head_bytes(CONFIG.head_dim, kv_dtype)
    assert pool.full_contexts(CONFIG.context_len) == 20 // (64 // 8)


def test_the_same_bytes_hold_more_blocks_when_quantized():
    # GPT-2 small at 1,000 full contexts is past the 1 GiB default: the cap decides the blocks
    gpt2 = GPTConfig(context_len=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)
    blocks = {kv: default_num_blocks(gpt2, 16, 1000, kv) for kv in ("float32", "bfloat16", "int8", "int4")}
    assert blocks["bfloat16"] == 2 * blocks["float32"]
    # 64 + 2 bytes a head against 256 (float32) and 128 (bfloat16); int4: 32 + 4
    assert blocks["int8"] == 2**30 // cache_bytes(gpt2, 16, 1, "int8") > 3.8 * blocks["float32"]
    assert blocks["int4"] > 7 * blocks["float32"] and blocks["int4"] > 3.5 * blocks["bfloat16"]


@pytest.mark.parametrize("kv_dtype, attention", [("int8", "gather"), ("int4", "gather"),
                                                 ("bfloat16", "gather"), ("int8", "kernel")])
def test_concurrent_prompts_equal_the_loop_with_the_same_kv_dtype(model, kv_dtype, attention):
    # lengths across block boundaries, one at the full context; 100 new tokens go past
    # context_len (64), so rows reprefill too. "kernel": the step compiled whole (its first
    # call compiles a graph for this pool: ~1 min on 2 cores), reading codes in place
    prompts = random_prompts([1, 5, 16, 17, 33, 64, 40])
    engine = Engine(model, TOKENIZER, tokens_per_block=8, max_batch=4, attention=attention,
                    kv_dtype=kv_dtype)
    assert engine.pool.kv_dtype == kv_dtype
    rows = run(engine, prompts, max_tokens=100, **GREEDY)
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 100, kv_dtype)
    assert_pool_is_whole(engine)


def test_prefix_sharing_and_preemption_keep_the_quantized_text(model):
    base = random_prompts([40], seed=1)[0]
    prompts = [base[:33] + tail for tail in random_prompts([1, 6, 20], seed=2)] + [base]
    prompts += random_prompts([3, 30, 12, 50], seed=4)
    # 10 blocks of 8 for 8 prompts that grow to 100+ tokens: preemption, and blocks of base
    # found again by the prompts that share it
    engine = Engine(model, TOKENIZER, num_blocks=10, tokens_per_block=8, max_batch=8,
                    attention="gather", kv_dtype="int8")
    run(engine, [base], max_tokens=4, **GREEDY)  # fills the prefix index
    rows = run(engine, prompts, max_tokens=60, **GREEDY)
    assert engine.scheduler.preemptions > 0 and engine.scheduler.cached_tokens >= 4 * 32
    for prompt, row in zip(prompts, rows):
        assert row == alone(model, prompt, 60, "int8")
    assert engine.peak_blocks <= 10
    assert_pool_is_whole(engine)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_prompt_logprobs_equal_a_forward_through_a_cache_of_the_same_dtype(model, kv_dtype):
    """A scored prompt is fed whole, its cached blocks read back through the format (as a
    preallocated KVCache of kv_dtype returns what it stores): the same log-probabilities
    within 1e-5, its first blocks cached by another request before it."""
    base = random_prompts([40], seed=9)[0]
    engine = Engine(model, TOKENIZER, tokens_per_block=8, attention="gather", kv_dtype=kv_dtype)
    run(engine, [base[:24]], max_tokens=3, **GREEDY)
    scored = engine.add_request(base, SamplingParams(max_tokens=0, prompt_logprobs=2, **GREEDY))
    engine.run_until_done()
    with torch.no_grad():
        cache = KVCache(CONFIG, 1, kv_dtype=kv_dtype)
        logits = model(torch.tensor([base]), cache)[0][0, :-1, :TOKENIZER.n_vocab]
    direct = torch.log_softmax(logits.float(), dim=-1)
    float_direct = torch.log_softmax(model(torch.tensor([base]))[0][0, :-1, :TOKENIZER.n_vocab], -1)
    got = torch.tensor([lp.logprob for lp in scored.prompt_logprobs[1:]])
    wanted = direct.gather(1, torch.tensor(base[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, wanted, atol=1e-5, rtol=0)
    # and the quantization shows: not the float forward's (int8's codes move keys by ~0.4%)
    assert (got - float_direct.gather(1, torch.tensor(base[1:])[:, None])[:, 0]).abs().max() > 1e-5
    assert_pool_is_whole(engine)


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as reply:
        return reply.read().decode()


def test_health_and_metrics_report_the_pools_bytes_and_full_contexts(model):
    pytest.importorskip("aiohttp")
    from serving.server import BackgroundServer
    engine = Engine(model, TOKENIZER, num_blocks=24, tokens_per_block=8, attention="gather",
                    kv_dtype="int4")
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, "tiny") as url:
            base = url.removesuffix("/v1")
            health = json.loads(get(base, "/health"))
            metrics = get(base, "/metrics")
    finally:
        engine.stop()
    pool_bytes = cache_bytes(CONFIG, 25 * 8, 1, "int4")
    assert health["kv_dtype"] == "int4" and health["pool_bytes"] == pool_bytes
    assert health["full_contexts"] == 24 // (64 // 8) == 3
    assert f"kvcache_kv_pool_bytes {float(pool_bytes)}" in metrics
    assert "kvcache_kv_pool_full_contexts 3.0" in metrics


def test_with_compile_a_quantized_pool_is_read_by_the_hand_written_kernel():
    # Engine(compile=True): the batch's step compiled with the weights frozen in (minutes
    # on 2 cores: max_autotune times its matmuls), its paged kernel the hand-written one,
    # here its int8 twin; no lone step (its dense cache would be float32), so one request
    # alone decodes through the batch's step too. A model of its own (the same weights):
    # the frozen graph holds them
    model = tiny_model(CONFIG, seed=3)
    prompts = random_prompts([6, 11], seed=6)
    engine = Engine(model, TOKENIZER, tokens_per_block=8, compile=True, kv_dtype="int8")
    assert engine.runner.lone is None
    with torch.profiler.profile() as profile:
        rows = run(engine, prompts, max_tokens=20, **GREEDY)
        alone_row = run(engine, prompts[:1], max_tokens=5, **GREEDY)
    assert any(event.name == "kvcache_gpt::decode_attention_quantized" for event in profile.events())
    assert rows == [alone(model, p, 20, "int8") for p in prompts]
    assert alone_row[0] == rows[0][:5]
    assert_pool_is_whole(engine)
