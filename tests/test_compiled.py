"""The static-shape decode step compiled ahead of time (generation/compiled_step.py): one
build for every step, the same tokens as the eager loop, sampling inside the step with the
model's distribution.

Graph logic is checked on the exported graph run by Python (conftest's `builds`:
torch.export's program, the graph AOTInductor compiles, without generating C++), so that a
build takes a second;
one test builds for real, on a 1-layer model to keep the C++ short. Token equality is
exact: the static step reads the masked whole buffer instead of the filled columns, which
changes only float rounding (~1e-6 on these logits), and these seeds have no near-ties."""

import pytest
import torch

from base_model import GPTConfig
from conftest import tiny_model
from generation import compiled_step, loop
from generation.loop import Generation, GenerationStats, generate_tokens
from generation.rows import Rows
from kv_cache import KVCache, KVCacheLlama
from kv_quant import cache_bytes
from llama import LlamaConfig
from sample import probabilities
from weight_quant import quantize_model

CONFIG = GPTConfig(context_len=32, vocab_size=260, n_layer=2, n_head=2, n_embd=32)


def greedy(model, prompts, n, **kw):
    return generate_tokens(model, prompts, n, temperature=0, **kw)


def test_one_build_for_every_step_and_the_same_tokens(builds):
    model = tiny_model(CONFIG, seed=21)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]  # left padding in the graph too
    n = 3 * CONFIG.context_len  # through reprefills (eager) between compiled steps
    stats = GenerationStats()
    compiled = greedy(model, prompts, n, compile=True, stats=stats)
    assert torch.equal(compiled, greedy(model, prompts, n))
    assert len(builds) == 1 and stats.compile_seconds > 0 and stats.reprefills > 0
    # a second generation of the same shapes reuses the build; other settings build anew
    greedy(model, prompts, 20, compile=True)
    assert len(builds) == 1
    generate_tokens(model, prompts, 5, temperature=0.5, compile=True)
    assert len(builds) == 2


def test_the_cache_holds_what_the_generation_reaches(builds, monkeypatch):
    """A generation's cache holds its prompt and new tokens rounded up to a multiple of
    CACHE_COLUMNS_STEP, at most the context: the compiled step reads every column, so a
    shorter buffer is a faster step. Lengths that round alike share one build."""
    monkeypatch.setattr(loop, "CACHE_COLUMNS_STEP", 8)
    model = tiny_model(CONFIG, seed=26)
    prompts = [[1, 2, 3]]
    for n, columns in ((4, 8), (5, 8), (6, 16), (40, CONFIG.context_len)):  # 3 + n rounded up
        stats = GenerationStats()
        compiled = greedy(model, prompts, n, compile=True, stats=stats)
        assert stats.cache_bytes == cache_bytes(CONFIG, columns, 1)
        assert torch.equal(compiled, greedy(model, prompts, n))
    assert len(builds) == 3  # 8 columns (n = 4 and 5), 16 and 32


def test_the_cache_grows_as_it_fills(builds, monkeypatch):
    """With compile the cache starts short and grows CACHE_GROWTH columns at a time, up to
    what the generation reaches (the compiled step reads every column of its buffer: a
    short one is a faster step), one build taking them all; the tokens are the eager
    loop's, with left padding and through reprefills past the context."""
    monkeypatch.setattr(loop, "CACHE_GROWTH", 4)
    sizes, grow = [], Rows.grow

    def noted(self, columns):
        sizes.append(columns)
        grow(self, columns)
    monkeypatch.setattr(Rows, "grow", noted)
    model = tiny_model(CONFIG, seed=27)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]  # padded to 5 columns: the cache starts with 8
    n = 2 * CONFIG.context_len
    stats = GenerationStats()
    assert torch.equal(greedy(model, prompts, n, compile=True, stats=stats), greedy(model, prompts, n))
    assert sizes == list(range(12, CONFIG.context_len + 1, 4)) and len(builds) == 1
    assert stats.reprefills > 0 and stats.cache_bytes == cache_bytes(CONFIG, CONFIG.context_len, 2)


def test_weights_changed_in_place_are_a_new_build(builds):
    """A float32 model's library holds its own copy of the weights: the step built before a
    change must not run after it."""
    model = tiny_model(CONFIG, seed=25)
    prompts = [[1, 2, 3]]
    greedy(model, prompts, 5, compile=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # tied: the token embedding too
    assert torch.equal(greedy(model, prompts, 20, compile=True), greedy(model, prompts, 20))
    assert len(builds) == 2


def test_unwritten_columns_holding_nan_change_nothing(builds, monkeypatch):
    """The static step reads the whole buffer, unwritten columns masked. The buffer is
    torch.empty, which may hold NaN bits, and a masked NaN still poisons attention (0 x NaN):
    this made the compiled tokens wrong now and then. Fill new buffers with NaN to be sure."""
    init = KVCache.__init__

    def nan_filled(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kv.fill_(float("nan"))
    monkeypatch.setattr(KVCache, "__init__", nan_filled)
    model = tiny_model(CONFIG, seed=24)
    prompts = [[1, 2, 3], [4, 5]]
    assert torch.equal(greedy(model, prompts, 20, compile=True), greedy(model, prompts, 20))


def test_single_row_num_samples_and_finished_rows(builds):
    model = tiny_model(CONFIG, seed=22)
    prompt = torch.tensor([[7, 8, 9, 10]])
    assert torch.equal(greedy(model, prompt, 40, compile=True), greedy(model, prompt, 40))
    generation = Generation(model, [[1], [2, 3]], 50, temperature=0, num_samples=2, compile=True)
    steps = 0
    for steps, (rows, tokens) in enumerate(generation, start=1):
        # finished rows stay in the compiled batch (one graph) but get no more tokens
        assert rows == ([0, 1, 2, 3] if steps <= 3 else [2, 3]) and tokens.shape == (len(rows),)
        for row in ((0, 1) if steps == 3 else (2, 3) if steps == 9 else ()):
            generation.finish(row)
    assert steps == 9


def test_sampling_inside_the_step_draws_from_the_model(builds):
    """The compiled step's draw (sample.sample_with_noise) against the model's own
    distribution: 4,000 rows of one prompt, two tokens each; the second comes from the
    compiled step, and its frequencies must match the mixture sum_t1 P(t1) P(t2 | t1)
    computed eagerly. Within 0.025 per token (4 standard deviations at p = 0.5 over 4,000
    rows is 0.032 at worst; these probabilities are smaller); a draw from the wrong
    distribution (the temperature ignored, or the filter dropped) misses by far more."""
    config = GPTConfig(context_len=16, vocab_size=8, n_layer=1, n_head=2, n_embd=16)
    model = tiny_model(config, seed=26)
    prompt, rows, settings = [3, 1, 4], 4000, dict(temperature=0.7, top_k=5)
    g = torch.Generator().manual_seed(0)
    tokens = generate_tokens(model, [prompt], 2, num_samples=rows, compile=True, generator=g,
                             **settings)
    with torch.no_grad():
        first = probabilities(model(torch.tensor([prompt]))[0][:, -1], **settings)[0]
        after = torch.stack([probabilities(model(torch.tensor([prompt + [t]]))[0][:, -1], **settings)[0]
                             for t in range(config.vocab_size)])  # (V, V): row t1, P(t2 | t1)
    expected = (first / first.sum()) @ (after / after.sum(-1, keepdim=True))
    freq = torch.bincount(tokens[:, 1], minlength=config.vocab_size).float() / rows
    assert (freq - expected).abs().max() < 0.025
    # and a seed fixes the text
    again = generate_tokens(model, [prompt], 2, num_samples=rows, compile=True,
                            generator=torch.Generator().manual_seed(0), **settings)
    assert torch.equal(tokens, again)


def test_needs_the_preallocated_cache(builds):
    model = tiny_model(CONFIG)
    with pytest.raises(ValueError, match="preallocated"):
        greedy(model, [[1, 2]], 3, compile=True, cache_kind="cat")


def test_aot_inductor_builds_once_and_matches_eager():
    """The real build: the C++ library, called without Python per step."""
    config = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = tiny_model(config, seed=23)
    prompts = [[1, 2, 3], [4, 5]]
    first, again = GenerationStats(), GenerationStats()
    assert torch.equal(greedy(model, prompts, 40, compile=True, stats=first), greedy(model, prompts, 40))
    assert torch.equal(greedy(model, prompts, 40, compile=True, stats=again), greedy(model, prompts, 40))
    assert first.compile_seconds > 0.5 and again.compile_seconds < 0.1  # built once, reused


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_build_gives_the_eager_logits_within_bf16_rounding(scheme):
    """The real build of a quantized model (--quantize int8|int4 --compile), 64 wide: int4's
    default groups of 64. With our kernels (weight_quant's "ours", where they build) the
    library calls the same operator as eager, and only inductor's fused fp32 arithmetic
    around it differs. With torch's (the fallback) not bit-equal: each quantized Linear
    casts its input to bf16 in both, but eager rounds each product to bf16 too (torch's
    kernels return bf16), where the library's kernel may keep float32 (inductor's template,
    when max_autotune picks it). That rounding is at most 2^-9 of each output; tolerance
    2^-7 of the logits' scale leaves room for the five Linears it passes through (c_attn,
    c_proj, the MLP's two, the lm_head), and holds for either kernel.
    Greedy tokens then agree wherever no two logits are that close (the bundled model from
    "ROMEO:", 200 of 200, docs/generation.md)."""
    config = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64)
    model = quantize_model(tiny_model(config, seed=23), scheme)
    tokens = torch.tensor([[5], [9]])
    with torch.no_grad():
        eager = model(tokens, KVCache(config, 2, "cpu", torch.float32))[0][:, -1]  # (2, V)
    cache = KVCache(config, 2, "cpu", torch.float32)
    step, _ = compiled_step.compile_for(model, cache)
    with torch.no_grad():
        logits = step.decode(tokens, cache)[:, -1]
    # int4's own error (its product against fp32's) is ~10x this bound on these weights
    assert (logits - eager).abs().max() <= 2**-7 * eager.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_llamas_library_reads_the_models_own_weights(dtype):
    """The real build of a quantized Llama (its rotary frequencies a plain tensor, not a
    buffer): the library is built without the weights and reads the model's tensors where
    they lie. The proof that there is no copy: a weight written in place after the build is
    what the next call computes with (the eager logits of the changed model, within the
    bf16 rounding of the test above). A float32 model's library keeps its frozen copy."""
    config = LlamaConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=64,
                         intermediate_size=128, tie_embeddings=True)  # an untied head stays float: a float32 one, frozen
    model = quantize_model(tiny_model(config, seed=23, cls=KVCacheLlama).to(dtype), "int8")
    assert compiled_step.reads_own_weights(model)
    assert not compiled_step.reads_own_weights(tiny_model(config, cls=KVCacheLlama))
    tokens = torch.tensor([[5], [9]])

    def logits_both_ways():
        with torch.no_grad():
            eager = model(tokens, KVCache(config, 2, "cpu", dtype))[0][:, -1].float()  # (2, V)
            cache = KVCache(config, 2, "cpu", dtype)
            cache.kv.zero_()
            return eager, step.decode(tokens, cache)[:, -1].float()
    step, _ = compiled_step.compile_for(model, KVCache(config, 2, "cpu", dtype))
    before, compiled = logits_both_ways()
    assert (compiled - before).abs().max() <= 2**-7 * before.abs().max()
    with torch.no_grad():
        model.lm_head.weight_int8.neg_()  # in place: the same tensor, other values
    after, compiled = logits_both_ways()
    assert (after - before).abs().max() > 0.1 * before.abs().max()  # a change the test can see
    assert (compiled - after).abs().max() <= 2**-7 * after.abs().max()


def test_the_lone_steps_build_gives_logits_and_greedy_picks_at_any_column_count():
    """The serving engine's lone step, built for real: two outputs come back from the
    library, the step's logits and each row's argmax among the first vocab_limit tokens
    only, as the engine samples (an embedding table's padding rows past the tokenizer's
    tokens are never picked; the limit is set at the first row's favourite token, so a
    pick over the whole vocabulary would differ); and, built with max_columns for the
    context's 16 columns, it runs on a cache of 8 (the column count a variable of the
    library)."""
    config = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    model = tiny_model(config, seed=23)
    tokens = torch.tensor([[5], [9]])
    with torch.no_grad():
        eager = model(tokens, KVCache(config, 2, "cpu", torch.float32))[0][:, -1]  # (2, V)
    limit = int(eager[0].argmax())
    assert limit > 0  # this seed's favourite is not token 0: a limit there leaves tokens to pick
    step, _ = compiled_step.compile_for(model, KVCache(config, 2, "cpu", torch.float32),
                                        vocab_limit=limit, greedy_too=True, max_columns=16)
    for columns in (16, 8):
        cache = KVCache(config, 2, "cpu", torch.float32, max_len=columns)
        cache.kv.zero_()  # unwritten columns are read (masked): no NaN in them
        with torch.no_grad():
            logits, picked = step.decode(tokens, cache)
        # tolerance 1e-5: the library computes the eager arithmetic in another order (~1e-6)
        assert torch.allclose(logits[:, -1], eager, atol=1e-5)
        assert torch.equal(picked, eager[:, :limit].argmax(-1))
        assert picked[0] != eager[0].argmax() and cache.length == 1
