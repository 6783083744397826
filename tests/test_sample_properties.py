"""Property tests of the sampler under hostile logits (hypothesis): random shapes, dtypes,
temperatures, top-k and top-p, with -inf, +inf, NaN, huge magnitudes and all-equal rows.

1,200 generated cases in all (max_examples below). The reference is float64 and knows
what fp32 can and cannot tell apart: see clearly_greater()."""

from contextlib import contextmanager
from unittest import mock

import torch
from hypothesis import given, settings, strategies as st

import sample as sampling

FP32 = torch.finfo(torch.float32)
INF, NAN = float("inf"), float("nan")
SPECIAL = [INF, -INF, NAN, 1e30, -1e30, FP32.max, -FP32.max, 0.0]
TEMPERATURES = [0.0, 5e-324, 1e-300, 1e-40, 1e-6, 0.01, 0.7, 1.0, 2.0, 100.0, 1e30, 1e300, INF]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL_P = 1e-4  # probability mass fp32 may get wrong vs float64: V * eps of the sums, plus exp of rounded logits


@st.composite
def hostile_logits(draw, min_b=1):
    """(B, V) logits: each row random, special-riddled or all equal, in fp32/fp16/bf16."""
    b, v = draw(st.integers(min_b, 4)), draw(st.integers(1, 64))
    value = st.one_of(st.floats(-20, 20, width=32), st.sampled_from(SPECIAL))
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["random", "special", "equal"]))
        if kind == "equal":
            rows.append([draw(value)] * v)
        elif kind == "random":
            rows.append(draw(st.lists(st.floats(-20, 20, width=32), min_size=v, max_size=v)))
        else:
            rows.append(draw(st.lists(value, min_size=v, max_size=v)))
    return torch.tensor(rows, dtype=torch.float32).to(draw(st.sampled_from(DTYPES)))


top_ks = st.none() | st.integers(1, 70)
top_ps = st.none() | st.sampled_from([1e-9, 0.1, 0.3, 0.5, 0.9, 0.999, 1 - 1e-7, 1.0]) | st.floats(0.01, 1.0)


@contextmanager
def checked_multinomial():
    """Patch torch.multinomial to assert that its input is a valid weight table, and record it."""
    seen, original = [], torch.multinomial

    def check(probs, *args, **kwargs):
        assert torch.isfinite(probs).all(), probs
        assert (probs >= 0).all() and (probs.sum(-1) > 0).all(), probs
        seen.append(probs.clone())
        return original(probs, *args, **kwargs)

    with mock.patch.object(sampling.torch, "multinomial", check):
        yield seen


def unchanged(x, before):
    """Bitwise equality: torch.equal says NaN != NaN."""
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    return x.dtype == before.dtype and torch.equal(x.view(bits), before.view(bits))


def reference_z(row, temperature):
    """float64 scaled logits of one row: NaN excluded (-inf); +inf rows keep only their +inf
    tokens (at 0); None when nothing can be sampled. Temperatures are clamped to fp32's
    range, as sample() documents."""
    x = row.double().nan_to_num(nan=-INF, posinf=INF, neginf=-INF)
    if torch.isposinf(x).any():
        x = torch.where(torch.isposinf(x), 0.0, -INF)
    if torch.isneginf(x).all():
        return None
    t = min(max(temperature, FP32.tiny), FP32.max)
    return (x - x.max()) / t


def clearly_greater(z):
    """[i, j]: z_i > z_j by more than fp32 can hide, so sample() cannot rank j above i, by
    logit or by probability. Hidden: rounding of (x - max) / T (2 eps relative per value,
    underflow included) and of exp (1 ulp each: exp(-1e-30) == exp(0) in fp32, 4 eps)."""
    zi, zj = z[:, None], z[None, :]
    finite = torch.where(torch.isfinite(z), z.abs(), 0.0)
    tol = 2 * FP32.eps * (finite[:, None] + finite[None, :]) + 4 * FP32.eps
    diff = torch.where(torch.isneginf(zj) & torch.isfinite(zi), INF, zi - zj)  # inf - inf is nan
    return diff.nan_to_num(nan=0.0) > tol


def check_row_support(support, z, top_k, top_p):
    """Every token sample() gives a chance (support) is allowed by the float64 reference."""
    candidate = torch.isfinite(z)
    assert not (support & ~candidate).any(), "an excluded (-inf/NaN, or finite beside +inf) token has weight"
    above = clearly_greater(z) & candidate[:, None]  # [i, j]: candidate i clearly above j
    in_top_k = torch.ones_like(candidate)
    if top_k is not None:  # superset of what top-k keeps: fewer than k tokens clearly above
        in_top_k = candidate & (above.sum(0) < top_k)
        assert not (support & ~in_top_k).any(), "a token outside the top-k has weight"
    if top_p is not None and top_p < 1:
        p = torch.where(candidate, (z - z[candidate].max()).exp(), 0.0)
        p = p / p[in_top_k].sum()  # renormalised over the top-k superset: a lower bound on sample's
        mass_above = (above * p[:, None]).sum(0)
        assert not (support & (mass_above >= top_p + TOL_P)).any(), "a token outside the nucleus has weight"


@settings(max_examples=500, deadline=None)
@given(hostile_logits(), st.sampled_from(TEMPERATURES[1:]), top_ks, top_ps)
def test_sample_gives_valid_allowed_tokens(logits, temperature, top_k, top_p):
    before = logits.clone()
    refs = [reference_z(row, temperature) for row in logits]
    if any(z is None for z in refs):  # documented: a row with nothing to sample is an error
        try:
            sampling.sample(logits, temperature, top_k, top_p)
        except ValueError:
            return
        raise AssertionError("no ValueError for a row of only -inf/NaN")
    with checked_multinomial() as seen:
        out = sampling.sample(logits, temperature, top_k, top_p)
    assert unchanged(logits, before)
    assert out.shape == (logits.size(0), 1) and out.dtype == torch.int64
    (probs,) = seen
    for row, (z, token) in enumerate(zip(refs, out.flatten().tolist())):
        assert 0 <= token < logits.size(1)
        assert probs[row, token] > 0
        check_row_support(probs[row] > 0, z, top_k, top_p)
        top = torch.isfinite(z) & ~clearly_greater(z).any(0)  # the most likely, to fp32's eye
        assert (probs[row][top] > 0).any(), "no most likely token kept"


@settings(max_examples=200, deadline=None)
@given(hostile_logits(), top_ks, top_ps)
def test_greedy_is_argmax_without_nan(logits, top_k, top_p):
    before = logits.clone()
    out = sampling.sample(logits, 0, top_k, top_p)
    assert unchanged(logits, before)
    assert out.shape == (logits.size(0), 1) and out.dtype == torch.int64
    for row, token in zip(logits.double(), out.flatten().tolist()):
        x = row.nan_to_num(nan=-INF, posinf=INF, neginf=-INF)
        assert 0 <= token < len(row) and x[token] == x.max()  # a tie may pick any of the maxima


@settings(max_examples=150, deadline=None)
@given(hostile_logits(min_b=2), st.sampled_from(TEMPERATURES), top_ks, top_ps)
def test_rows_are_independent(logits, temperature, top_k, top_p):
    """A row's weights (greedy: its token) do not depend on the rows sampled beside it."""
    if any(reference_z(row, temperature) is None for row in logits) and temperature > 0:
        return  # covered by the ValueError case above
    with checked_multinomial() as batch:
        out = sampling.sample(logits, temperature, top_k, top_p)
    for i in range(logits.size(0)):
        with checked_multinomial() as alone:
            out_i = sampling.sample(logits[i:i + 1], temperature, top_k, top_p)
        if temperature == 0:
            assert out_i.item() == out[i].item()
        else:
            assert torch.equal(alone[0][0], batch[0][i])


@settings(max_examples=300, deadline=None)
@given(hostile_logits(), st.data())
def test_top_p_filter_keeps_the_smallest_nucleus(logits, data):
    """Against the brute-force definition: sort, keep the shortest prefix whose mass >= p.
    Tolerance: top_p_filter sums in fp32, so p is only known to within TOL_TOP_P: the kept
    count must lie between the float64 answers for p - TOL_TOP_P and p + TOL_TOP_P. Ties
    between equal probabilities may go either way, so the prefix is checked by value (no
    dropped token beats a kept one)."""
    TOL_TOP_P = 1e-5  # fp32 cumsum of <= 64 terms <= 1: 64 * eps/2 per partial sum, with margin
    probs = logits.float().nan_to_num(nan=-INF).softmax(-1).nan_to_num(nan=0.0)  # rows of +inf: 0
    probs = probs[probs.sum(-1) > 0]
    if len(probs) == 0:
        return
    # p at, and 1e-4 either side of, a mass the first row's prefixes reach: the boundary
    # cases where an off-by-one (> for >=, inclusive cumsum) shows
    sums = probs[0].double().sort(descending=True).values.cumsum(0).tolist()
    edges = [min(max(x + d, 1e-9), 1.0) for x in sums for d in (-1e-4, 0.0, 1e-4)]
    p = data.draw(st.floats(1e-9, 1.0) | st.sampled_from([0.5, 1 - 1e-7, 1.0] + edges))
    before = probs.clone()
    out = sampling.top_p_filter(probs, p)
    assert torch.equal(probs, before) and out.shape == probs.shape and out.dtype == probs.dtype
    for q, o in zip(probs.double(), out.double()):
        kept, dropped = (o > 0), (q > 0) & (o == 0)
        assert torch.equal(o[kept], q[kept]), "kept tokens keep their probability"
        assert kept[q == q.max()].any(), "the most likely token is kept"
        if dropped.any():
            assert q[kept].min() >= q[dropped].max(), "the nucleus is a prefix of the sorted order"
        # brute force: sort, the shortest prefix whose mass reaches p; its length, to within
        # the tolerance on either side of p (capped: fp32 mass may fall short of p ~ 1)
        cum = q[q > 0].sort(descending=True).values.cumsum(0)
        shortest = [min(1 + int((cum < p + d).sum()), len(cum)) for d in (-TOL_TOP_P, TOL_TOP_P)]
        assert shortest[0] <= int(kept.sum()) <= shortest[1], (int(kept.sum()), shortest)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 64), st.sampled_from(DTYPES),
       st.sampled_from(TEMPERATURES[1:]), st.data())
def test_row_with_nothing_to_sample_raises(b, v, dtype, temperature, data):
    logits = torch.randn(b, v).to(dtype)
    row = data.draw(st.integers(0, b - 1))
    logits[row] = torch.tensor(data.draw(st.lists(st.sampled_from([-INF, NAN]), min_size=v, max_size=v)))
    try:
        sampling.sample(logits, temperature)
    except ValueError as e:
        assert "excludes every token" in str(e)
    else:
        raise AssertionError("expected ValueError")

