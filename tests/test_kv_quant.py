"""The quantized and cast caches (kv_quant.py): round trips within their schemes' bounds,
logits through every kind, batches, bytes equal to the formula, and the planner.

Tolerances, each derived from the scheme:
- A symmetric code is off by at most half a step, scale/2 per value (scale = max|x| / qmax
  of its group, stored in float16: the code is computed from the stored scale, so the bound
  is half the stored scale; 1e-6 absolute on top for float32 arithmetic).
- Logits through a kind vs a float32 cache: a value stored with relative rounding u (of its
  group's max: bf16 2^-9, fp16 2^-12, int8 1/254, int4 1/14) moves an attention output, a
  convex combination of values, by at most u of their max, and moves the softmax weights by
  a similar relative amount through the keys; tiny random models do not amplify it. So
  max |logit difference| <= u x (the logits' range, max - min). Observed 3-5x below that
  (int8 ~1e-3, int4 ~2e-2 of the range); a wrong scale, group or column moves logits by
  the whole range.
- Logits through a quantized cache vs a reference that stores round_trip(k), round_trip(v)
  in float32 (a list cache): the same numbers in differently shaped ops: 1e-4 absolute, as
  in test_parity.py.
"""

import math

import pytest
import torch

from base_model import GPT, GPTConfig
from conftest import TINY_CONFIGS, byte_tokenizer, tiny_model
from generation.loop import Generation, GenerationStats, generate_tokens
from kv_cache import ConcatCache, KVCache
from kv_quant import (KV_DTYPES, QUANT_BITS, FloatFormat, QuantizedFormat, cache_bytes, dequantize,
                      group_size, head_bytes, pack_int4, quantize, unpack_int4)
from memory_plan import NAMED, Shape, gpt2_params, llama_params, parse_bytes
from memory_plan import windowed_cache_bytes as planned_bytes
from test_batch import alone, batched, random_prompts

QUANT = list(QUANT_BITS)
RELATIVE_ROUNDING = {"float32": 2 ** -24, "bfloat16": 2 ** -9, "float16": 2 ** -12,
                     "int8": 1 / 254, "int4": 1 / 14}
SHORT = GPTConfig(context_len=32, vocab_size=260, n_layer=2, n_head=2, n_embd=32)


def hostile_values(shape, seed=0):
    """Random values with outliers, tiny and huge groups, and all-zero head vectors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-2])[:, None]
    x[..., 3] *= 50           # an outlier channel, as real keys have
    x[..., 1, :] = 0          # a head vector of zeros
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_round_trip_within_half_a_step(bits, group):
    x = hostile_values((3, 2, 16, 64))
    codes, scales = quantize(x, bits, group)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert codes.abs().max() <= 2 ** (bits - 1) - 1
    error = (dequantize(codes, scales, torch.float32) - x).abs().unflatten(-1, (-1, group))
    assert (error <= scales.float()[..., None] / 2 + 1e-6).all()
    assert (dequantize(codes, scales, torch.float32)[..., 1, :] == 0).all()  # zeros stay zeros


def test_int4_packing_is_exact():
    codes = torch.randint(-7, 8, (5, 7, 64), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed).to(torch.int8) - 8, codes)


@pytest.mark.parametrize("kind", QUANT)
def test_cache_returns_what_the_scheme_promises(config, kind):
    cache = KVCache(config, batch_size=2, kv_dtype=kind)
    assert isinstance(cache.format, QuantizedFormat) and cache.kv.dtype == torch.uint8
    shape = (2, config.n_head, 5, config.head_dim)
    k, v = hostile_values(shape, 1), hostile_values(shape, 2)
    last = config.n_layer - 1  # the cache counts new columns once the last layer has stored them
    cache.update(last, k[:, :, :3], v[:, :, :3])
    assert cache.length == 3
    k_all, v_all = cache.update(last, k[:, :, 3:], v[:, :, 3:])  # the old columns read back too
    group = group_size(config.head_dim, kind)
    for x, got in ((k, k_all), (v, v_all)):
        assert got.shape == x.shape and got.dtype == torch.float32
        _, scales = quantize(x, QUANT_BITS[kind], group)
        assert ((got - x).abs().unflatten(-1, (-1, group)) <= scales.float()[..., None] / 2 + 1e-6).all()


def test_float_kinds_are_the_preallocated_cache():
    config = TINY_CONFIGS[0]
    same = KVCache(config, 1, kv_dtype="float32")  # the model's dtype: views of the buffer
    k = torch.randn(1, config.n_head, 4, config.head_dim)
    k_all, _ = same.update(0, k, k)
    assert k_all.data_ptr() == same.kv.data_ptr()  # no copy: attention reads the buffer
    cache = KVCache(config, 2, kv_dtype="bfloat16")
    assert isinstance(cache.format, FloatFormat) and cache.kv.dtype == torch.bfloat16
    k = torch.randn(2, config.n_head, 4, config.head_dim)
    k_all, _ = cache.update(0, k, k)
    assert k_all.dtype == torch.float32  # attention runs in the model's dtype
    assert torch.equal(k_all, k.to(torch.bfloat16).float())


class RoundedCache(ConcatCache):
    """The reference: a list cache that stores every key and value already rounded by the
    scheme, in float32."""

    def __init__(self, kind, config):
        super().__init__(config.n_layer)
        self.bits, self.group = QUANT_BITS[kind], group_size(config.head_dim, kind)

    def update(self, layer, k, v):
        def rounded(x):
            return dequantize(*quantize(x, self.bits, self.group), x.dtype)
        return super().update(layer, rounded(k), rounded(v))


def feed(model, idx, cache, chunks):
    pieces, start = [], 0
    for size in chunks:
        pieces.append(model(idx[:, start:start + size], cache)[0])
        start += size
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 12]], ids=["token-by-token", "uneven"])
def test_quantized_cache_equals_rounded_reference(config, kind, chunks):
    model = tiny_model(config)
    idx = torch.randint(config.vocab_size, (3, 20))
    got = feed(model, idx, model.new_cache(3, kind), chunks)
    expected = feed(model, idx, RoundedCache(kind, config), [20])
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_logits_close_to_float32_cache(config, kind):
    model = tiny_model(config, seed=1)
    idx = torch.randint(config.vocab_size, (3, 30))
    full, _ = model(idx)
    got = feed(model, idx, model.new_cache(3, kind), [5] + [1] * 25)
    logit_range = (full.amax(-1) - full.amin(-1)).mean()
    assert (got - full).abs().max() <= RELATIVE_ROUNDING[kind] * logit_range + 1e-5


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_batches_reprefill_and_shrink_as_each_row_alone(kind):
    # left padding, reprefill past the context (10x the context), one prefill shared by
    # num_samples (Rows.repeat), rows that finish: every row as it would be alone. Exact:
    # a row's rounding never depends on the other rows.
    model = tiny_model(SHORT, seed=12)
    prompts = random_prompts([1, 7, 20, 40], SHORT.vocab_size, seed=1)
    n, stats = 10 * SHORT.context_len, GenerationStats()
    rows = batched(model, prompts, n, temperature=0, cache_kind=kind, stats=stats, num_samples=2)
    for i, prompt in enumerate(prompts):
        expected = alone(model, prompt, n, temperature=0, cache_kind=kind)
        assert rows[2 * i] == rows[2 * i + 1] == expected
    assert stats.reprefills >= n // (SHORT.context_len // 2) and stats.prefill_passes == 1
    generation, seen = Generation(model, prompts, 80, temperature=0, cache_kind=kind), []
    for step, (active, tokens) in enumerate(generation):
        seen.append(dict(zip(active, tokens.tolist())))
        if step == 10:
            generation.finish(1)
    assert all(1 not in step for step in seen[11:]) and all(1 in step for step in seen[:11])
    assert [step[2] for step in seen] == rows[4][:80]


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_greedy_agrees_with_float32_cache(kind):
    # Greedy decoding flips only at a near-tie of the top two logits, which the rounding
    # (bounded above) can cross; after a flip the texts part ways. These seeded tiny models
    # have none: all 120 tokens agree for every kind (also on seeds 6 and 7). On the bundled
    # model near-ties are common; `python -m benchmarks.kv_dtypes` reports its agreement.
    config = GPTConfig(context_len=160, vocab_size=260, n_layer=2, n_head=2, n_embd=32)
    model = tiny_model(config, seed=5)
    prompt = torch.randint(config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    reference = model.generate(prompt, 120, temperature=0)[:, 8:]
    got = generate_tokens(model, prompt, 120, temperature=0, cache_kind=kind)
    assert torch.equal(got, reference)


@pytest.mark.parametrize("kind", KV_DTYPES)
def test_bytes_equal_formula(config, kind):
    for batch, max_len in ((1, None), (3, 17)):
        cache = KVCache(config, batch, max_len=max_len, kv_dtype=kind)
        assert cache.nbytes() == cache_bytes(config, max_len or config.context_len, batch, kind)
    if kind in QUANT:  # the scales are counted: codes alone would be fewer bytes
        assert head_bytes(config.head_dim, kind) > config.head_dim * QUANT_BITS[kind] / 8


@pytest.mark.parametrize("kind", KV_DTYPES)
@pytest.mark.parametrize("n_kv_head, sliding_window", [(4, None), (1, None), (2, 24)],
                         ids=["MHA", "MQA", "GQA+window"])
def test_planner_bytes_equal_real_cache_tensors(kind, n_kv_head, sliding_window):
    # A cache holds the key/value heads only, and a sliding window caps its columns: the
    # real cache of such a model is one of n_kv_head heads and min(L, window) columns.
    shape = Shape("tiny", n_layer=3, n_head=4, n_kv_head=n_kv_head, head_dim=32, params=0,
                  context_len=64, sliding_window=sliding_window)
    cached = GPTConfig(context_len=64, n_layer=3, n_head=n_kv_head, n_embd=32 * n_kv_head)
    for length in (10, 40, 64):
        real = KVCache(cached, batch_size=2, max_len=min(length, sliding_window or length), kv_dtype=kind)
        assert planned_bytes(shape, kind, length, batch_size=2) == real.nbytes()


def test_parameter_counts():
    for config in TINY_CONFIGS:
        if config.bias:
            assert gpt2_params(config.n_layer, config.n_embd, config.vocab_size,
                               config.context_len) == GPT(config).num_params()
    counts = {s.name.split("-like")[0]: s.params for s in NAMED}
    # the published sizes of the models these shapes copy
    assert counts["GPT-2 small"] == 124_439_808 and counts["GPT-2 xl"] == 1_557_611_200
    assert counts["Llama-2-7B"] == 6_738_415_616 and counts["Llama-3-8B"] == 8_030_261_248
    assert counts["Mistral-7B"] == 7_241_732_096
    assert llama_params(1, 8, 2, 1, 16, 10) == 2 * 10 * 8 + (2 * 64 + 2 * 8 * 4 + 3 * 8 * 16 + 16) + 8


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2 ** 30 and parse_bytes("80 GB") == 80 * 10 ** 9
    assert parse_bytes("512") == 512 and parse_bytes("1.5mib") == 3 * 2 ** 19
    with pytest.raises(ValueError, match="24GiB"):
        parse_bytes("lots")


def test_odd_head_dim_is_refused_in_one_line():
    config = GPTConfig(context_len=8, vocab_size=10, n_layer=1, n_head=3, n_embd=18)  # head_dim 6
    with pytest.raises(ValueError, match="divisible by 4"):
        KVCache(config, 1, kv_dtype="int4")


@pytest.mark.parametrize("kind", ["float32", "int4"])
def test_score_through_cache(kind):
    # the same windows as the plain score: float32 through the cache gives the same loss
    # (float noise only), int4 a loss close to it; rows=2 splits the windows into batches
    from plumbing.scoring import nats_through_cache, score, score_windows
    config = GPTConfig(context_len=32, vocab_size=260, n_layer=2, n_head=2, n_embd=32)
    model, tokenizer = tiny_model(config, seed=3), byte_tokenizer()
    text = "Fair is foul, and foul is fair: hover through the fog and filthy air. " * 3
    plain = score(model, tokenizer, text, "cpu")
    through = score(model, tokenizer, text, "cpu", kind)
    assert plain["tokens"] == through["tokens"] == len(text.encode())
    bound = 1e-5 if kind == "float32" else 0.05
    assert math.isclose(through["nats_per_token"], plain["nats_per_token"], abs_tol=bound)
    ids = torch.tensor([256] + list(text.encode()))
    windows = score_windows(len(text), config.context_len)
    assert len(windows) > 2 and windows[1] == (16, 48, 16)
    nats = nats_through_cache(ids, windows, config.context_len, lambda rows: model.new_cache(rows, kind),
                              lambda tokens, cache: model(tokens, cache)[0], rows=2)
    assert nats / len(text) == pytest.approx(through["nats_per_token"], rel=1e-5)
