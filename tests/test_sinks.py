"""Past the context, the sinks policy (generation/loop.py, Generation.evict): the first few
tokens stay, the oldest after them goes, the rest move down a position by a rotation of
their cached keys, nothing is computed again (StreamingLLM).

The reference here is StreamingLLM written the naive way, as its paper describes it: keep
every kept token's key *before* rotation, and at every step rotate all of them afresh to
their places in the cache (0, 1, ...), the new query to the next one. Ours stores keys
after rotation and turns the kept ones back by one position's angle when one is forgotten.
The two must give the same tokens: rotations add up, so that is the claim under test.
Greedy tokens are compared exactly, far past the context (random weights with
initializer_range 0.1: no near-ties); logits step by step within 1e-4 (fp32: the two
compute the same angles by different sums, ~1e-6 apart)."""

import math

import pytest
import torch
import torch.nn.functional as F

from base_model import GPTConfig
from conftest import spread_out, tiny_model
from generation.loop import Generation, GenerationStats, generate_tokens
from kv_cache import KVCacheLlama
from llama import LlamaConfig, rotate

CONFIG = LlamaConfig(context_len=24, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                     intermediate_size=48, rope_theta=500.0, qk_norm=True)
SINKS = 4


def random_llama(seed=0):
    return spread_out(tiny_model(CONFIG, seed, KVCacheLlama), 0.3)


@torch.no_grad()
def streaming_reference(model, prompt, n, sinks=SINKS):
    """n greedy tokens, StreamingLLM the naive way: per layer, the unrotated keys and the
    values of the tokens kept (the first `sinks`, then the newest), rotated at every step
    to positions 0.. of the cache; the new token goes at the next position. Returns
    (tokens, the logits of every step)."""
    c = model.config
    kept = [[] for _ in range(c.n_layer)]  # per layer: [(k (n_kv_head, hd) before rotation, v)]
    tokens, logits_seen, feed = [], [], list(prompt)
    while len(tokens) < n:
        for token in feed:
            if len(kept[0]) == c.context_len:  # full: forget the oldest after the sinks
                for layer in kept:
                    del layer[sinks]
            logits = one_token(model, token, kept)
        logits_seen.append(logits)
        feed = [int(logits.argmax())]
        tokens.append(feed[0])
    return tokens, torch.stack(logits_seen)


def one_token(model, token, kept):
    """Logits (V,) of `token` after the kept tokens, extending `kept` by its key and value."""
    c = model.config
    x = model.model.embed_tokens(torch.tensor([token]))                    # (1, C)
    for block, layer in zip(model.model.layers, kept):
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(c.n_head, c.head_dim))
        k = attn.k_norm(attn.k_proj(h).view(c.n_kv_head, c.head_dim))
        layer.append((k, attn.v_proj(h).view(c.n_kv_head, c.head_dim)))
        n = len(layer)
        cos, sin = model.rotary(torch.arange(n))                          # (1, n, hd/2)
        keys = rotate(torch.stack([k for k, _ in layer], dim=1), cos, sin)  # (n_kv_head, n, hd)
        values = torch.stack([v for _, v in layer], dim=1)
        q = rotate(q[:, None], cos[:, -1:], sin[:, -1:])                   # (nh, 1, hd)
        group = c.n_head // c.n_kv_head  # query head h reads key/value head h // group
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        weights = F.softmax(q @ keys.transpose(1, 2) / math.sqrt(c.head_dim), dim=-1)
        y = (weights @ values).reshape(1, c.n_head * c.head_dim)
        x = x + attn.o_proj(y)
        x = x + block.mlp(block.post_attention_layernorm(x))
    return model.head(x)[0]


@pytest.mark.parametrize("kind", [None, "cat"], ids=["KVCache", "torch.cat"])
def test_sinks_equal_streamingllm_computed_naively(kind):
    model = random_llama()
    prompt = list(range(1, 11))
    n = 3 * CONFIG.context_len  # the cache fills after 14 tokens, then forgets one a step
    expected, _ = streaming_reference(model, prompt, n)
    stats = GenerationStats()
    ours = generate_tokens(model, [prompt], n, temperature=0, context_policy="sinks",
                           cache_kind=kind, stats=stats)
    assert ours[0].tolist() == expected
    assert stats.evictions == len(prompt) + n - 1 - CONFIG.context_len and stats.reprefills == 0
    assert stats.positions_processed == len(prompt) + n - 1  # nothing computed twice


def test_sinks_logits_step_by_step():
    """The logits of every step, not only their argmax, within 1e-4 of the reference."""
    model = random_llama(seed=3)
    prompt = [5, 6, 7]
    n = 3 * CONFIG.context_len
    expected_tokens, expected_logits = streaming_reference(model, prompt, n)
    seen = []
    generation = Generation(model, [prompt], n, temperature=0, context_policy="sinks")
    choose = generation.choose

    def recording(logits):  # every step's logits (R, V), as the loop chooses from them
        seen.append(logits[0])
        return choose(logits)
    generation.choose = recording
    tokens = [int(t) for _, t in generation]
    assert tokens == expected_tokens and len(seen) == n
    diff = (torch.stack(seen) - expected_logits).abs().max().item()
    print(f"\n  max |logit diff| sinks vs the naive reference, {n} steps: {diff:.2e}")
    assert diff < 1e-4


def test_each_row_of_a_padded_batch_evicts_as_it_would_alone():
    """Rows fill at different steps: a row that is not full forgets a padding column, not
    a token, so each row's text is the one it gets alone."""
    model = random_llama(seed=1)
    prompts = [[3], list(range(10, 22)), [7, 8, 9, 10, 11]]
    n = CONFIG.context_len + 8  # the longest row evicts from its 13th token, the shortest at its 24th
    batch = generate_tokens(model, prompts, n, temperature=0, context_policy="sinks")
    for row, prompt in zip(batch, prompts):
        assert row.tolist() == streaming_reference(model, prompt, n)[0]


def test_compiled_step_evicts_the_same(builds):
    """The static step (generation/compiled_step.py, run as its exported graph: the
    `builds` fixture) on a Llama: rotary angles from a position tensor, n_kv_head heads read
    in groups, evictions (eager) between its steps, left padding; one program, the eager
    loop's tokens."""
    model = random_llama(seed=2)
    prompts = [[1, 2, 3], list(range(20, 29))]
    n = CONFIG.context_len
    eager = generate_tokens(model, prompts, n, temperature=0, context_policy="sinks")
    compiled = generate_tokens(model, prompts, n, temperature=0, context_policy="sinks", compile=True)
    assert torch.equal(eager, compiled)
    assert len(builds) == 1


def test_sinks_are_refused_where_they_cannot_work():
    gpt = tiny_model(GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="needs rotary positions"):
        Generation(gpt, [[1]], 4, context_policy="sinks")
    model = random_llama()
    with pytest.raises(ValueError, match="int8 cache would round"):
        Generation(model, [[1]], 4, context_policy="sinks", cache_kind="int8")
    with pytest.raises(ValueError, match="sinks must be in 0..22"):
        Generation(model, [[1]], 4, context_policy="sinks", sinks=23)
    with pytest.raises(ValueError, match="unknown context policy"):
        Generation(model, [[1]], 4, context_policy="slide")
