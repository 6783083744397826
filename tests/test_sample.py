"""sample(): greedy, temperature, top-k, top-p, argument checks, no mutation, seeding; and
sample_with_noise(), the compiled step's draw, against the same distribution."""

import math

import pytest
import torch

from sample import probabilities, sample, sample_rows_with_noise, sample_with_noise

N = 4000  # draws per empirical check; frequencies are then within ~0.02 of their probability


def draws(logits, **kw):
    """N samples from a single row of logits, as a flat tensor of token ids."""
    g = torch.Generator().manual_seed(0)
    return sample(logits.expand(N, -1), generator=g, **kw).squeeze(1)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1, keepdim=True))


def test_shape_and_dtype():
    out = sample(torch.randn(3, 17))
    assert out.shape == (3, 1) and out.dtype == torch.long


def test_top_k_keeps_only_the_k_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, 2.9, -1.0]])
    assert set(draws(logits, top_k=3).tolist()) == {1, 3, 4}
    assert set(draws(logits, top_k=1).tolist()) == {1}


def test_top_k_larger_than_vocab_is_clamped():
    logits = torch.zeros(1, 4)
    assert set(draws(logits, top_k=100).tolist()) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # 0.5 < 0.6, then 0.5 + 0.3 = 0.8 reaches 0.6: the nucleus is {0, 2}
    assert set(draws(logits, top_p=0.6).tolist()) == {0, 2}
    # exactly reaching p counts: 0.5 + 0.3 = 0.8 >= 0.8
    assert set(draws(logits, top_p=0.8).tolist()) == {0, 2}
    assert set(draws(logits, top_p=0.81).tolist()) == {0, 2, 3}
    # the most likely token always stays, however small p is
    assert set(draws(logits, top_p=0.01).tolist()) == {0}


def test_top_p_renormalises_within_the_nucleus():
    logits = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    counts = torch.bincount(draws(logits, top_p=0.6), minlength=4).float() / N
    assert abs(counts[0].item() - 0.5 / 0.8) < 0.03 and abs(counts[2].item() - 0.3 / 0.8) < 0.03


def test_top_k_and_top_p_combine():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k=3 leaves 0.4, 0.3, 0.2 (renormalised 0.44, 0.33, 0.22); top-p 0.7 then keeps 2
    assert set(draws(logits, top_k=3, top_p=0.7).tolist()) == {0, 1}


def entropy_of_draws(samples, vocab):
    p = torch.bincount(samples, minlength=vocab).float() / len(samples)
    p = p[p > 0]
    return -(p * p.log()).sum().item()


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    h = {t: entropy_of_draws(draws(logits, temperature=t), 5) for t in (0.3, 1.0, 3.0)}
    assert h[0.3] < h[1.0] < h[3.0] < math.log(5) + 1e-6
    # at T=1 the frequencies follow softmax(logits)
    freq = torch.bincount(draws(logits), minlength=5).float() / N
    assert (freq - logits.softmax(-1)[0]).abs().max().item() < 0.03


def test_input_is_not_modified():
    for kw in ({}, {"temperature": 0}, {"top_k": 2}, {"top_p": 0.5}, {"temperature": 0.5, "top_k": 3, "top_p": 0.9}):
        logits = torch.randn(2, 10)
        before = logits.clone()
        sample(logits, **kw)
        assert torch.equal(logits, before), kw


@pytest.mark.parametrize("kw, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_arguments_raise(kw, message):
    with pytest.raises(ValueError, match=message):
        sample(torch.randn(1, 5), **kw)


def test_generator_makes_sampling_reproducible():
    logits = torch.randn(4, 100)
    a = sample(logits, generator=torch.Generator().manual_seed(7))
    b = sample(logits, generator=torch.Generator().manual_seed(7))
    many = {tuple(sample(logits, generator=torch.Generator().manual_seed(s)).flatten().tolist())
            for s in range(5)}
    assert torch.equal(a, b) and len(many) > 1


def test_rows_are_sampled_independently():
    # row 0 can only pick token 0, row 1 only token 2, whatever the other row holds
    logits = torch.tensor([[5.0, -float("inf"), -float("inf")], [-float("inf"), -float("inf"), 1.0]])
    assert sample(logits).flatten().tolist() == [0, 2]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                dict(temperature=1.3, top_p=0.8), dict(top_k=4, top_p=0.9)])
def test_noise_draw_has_sample_s_distribution(kw):
    """argmax(p / E), E ~ Exp(1) per token, picks token i with probability p_i / sum p.
    N = 20,000 draws: each frequency is within 0.015 of its probability (4 standard
    deviations at p = 0.5 is 0.014); a draw ignoring p (argmax of -E) would miss by 0.1+."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0]])
    n = 20_000
    g = torch.Generator().manual_seed(3)
    noise = torch.empty(n, logits.size(1)).exponential_(generator=g)
    tokens = sample_with_noise(logits.expand(n, -1), noise, **kw)[:, 0]
    freq = torch.bincount(tokens, minlength=logits.size(1)).float() / n
    p = probabilities(logits, **kw)[0]
    assert (freq - p / p.sum()).abs().max() < 0.015
    assert set(tokens.tolist()) == set(p.nonzero()[:, 0].tolist())  # nothing filtered is drawn


def test_noise_draw_greedy_ignores_the_noise():
    logits = torch.randn(5, 50)
    noise = torch.rand(5, 50)
    assert torch.equal(sample_with_noise(logits, noise, temperature=0), logits.argmax(-1, keepdim=True))


def test_row_draw_is_each_row_s_noise_draw():
    """sample_rows_with_noise, given G = -log(E): each row as sample_with_noise draws it
    with E and that row's temperature (0: argmax, whatever the noise); compiled, the same
    tokens. argmax(log p + G) and argmax(p / E) are the same token unless two candidates
    tie to float32's precision, which these draws do not."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g) * 3
    noise = torch.empty(6, 40).exponential_(generator=g)
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0, 1e-50, 1e300])  # the last two: float32 0 and inf
    rows = sample_rows_with_noise(logits, -noise.log(), temperature)
    for i, t in enumerate([0.0, 0.5, 1.0, 2.0, 0.0, 1e300]):
        assert rows[i] == sample_with_noise(logits[i:i + 1], noise[i:i + 1], temperature=t)[0, 0]
    assert rows[0] == logits[0].argmax()
    compiled = torch.compile(sample_rows_with_noise, fullgraph=True)
    assert torch.equal(compiled(logits, -noise.log(), temperature), rows)
    assert torch.equal(sample_rows_with_noise(logits, -noise.log(), torch.zeros(6)), logits.argmax(-1))


def test_row_draw_has_sample_s_distribution():
    """20,000 rows of one set of logits at temperature 0.7, each with its own Gumbel noise:
    each token's frequency within 0.015 of sample()'s probability (as above)."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    n = 20_000
    gumbel = -torch.empty(n, 6).exponential_(generator=torch.Generator().manual_seed(6)).log()
    tokens = sample_rows_with_noise(logits.expand(n, -1), gumbel, torch.full((n,), 0.7))
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert (freq - probabilities(logits[None], temperature=0.7)[0]).abs().max() < 0.015
