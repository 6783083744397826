"""
Turning logits into tokens: temperature, top-k, top-p (nucleus), min-p and greedy.

    P(x_i) = exp(z_i / T) / sum_j exp(z_j / T)

Temperature T < 1 sharpens the distribution, T > 1 flattens it, T = 0 is greedy argmax.
Top-k keeps the k most likely tokens; top-p keeps the smallest set of most likely tokens
whose probabilities add up to at least p, so the pool shrinks when the model is confident;
min-p keeps the tokens at least min_p times as likely as the likeliest.

Before temperature, logits processors may change the logits z of a row, in this order
(vLLM's and llama.cpp's): bans (tokens that may not come: ban), logit_bias, the
repetition penalty, then the presence and frequency penalties. Each is one function below,
its formula in its docstring; they read what the row has said so far, which the caller
keeps (generation/logits_processors.py). The order of the whole step:

    bans -> bias -> repetition -> presence/frequency -> temperature -> top-k -> top-p -> min-p
"""

import torch
import torch.nn.functional as F

FP32 = torch.finfo(torch.float32)


def check_sampling_args(temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Raise ValueError for settings that have no meaning, before any work is done."""
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if not temperature >= 0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def without_nan(logits):
    """NaN -> -inf, infinities kept. All three values must be given: nan_to_num's defaults
    turn +-inf into the dtype's finite extremes, which made -inf tokens sampleable (they got
    weight at huge temperatures) and an all -inf row never raise."""
    return logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def clean_logits(logits):
    """fp32 copy of logits (B, V) that softmax cannot turn into NaN.

    A NaN logit is treated as an excluded token. A +inf logit means "certain": when a row
    has any, only those tokens stay in it, equally likely. A row with no finite or +inf
    logit has no token to pick, and that is an error rather than a silent choice."""
    logits = without_nan(logits.float())
    # A compiled graph cannot branch on values, so it leaves out the two checks below: they
    # are for logits from elsewhere (a model's own are finite)
    if not torch.compiler.is_compiling():
        certain = torch.isposinf(logits)
        if certain.any():
            has_certain = certain.any(dim=-1, keepdim=True)
            logits = torch.where(has_certain, torch.where(certain, 0.0, float("-inf")), logits)
        if torch.isneginf(logits).all(dim=-1).any():
            raise ValueError("a row of logits excludes every token (all -inf or NaN): nothing to sample")
    # softmax does not change when a row's max is subtracted; doing it first means that
    # dividing by a tiny temperature cannot overflow to inf
    return logits - logits.amax(dim=-1, keepdim=True)


def top_k_filter(logits, k):
    """Keep exactly the k largest logits of each row (ties broken by index), -inf elsewhere."""
    k = min(k, logits.size(-1))
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def top_p_filter(probs, p):
    """Zero every token outside the nucleus: the smallest set of most likely tokens whose
    probabilities reach p. A token stays when the tokens ranked above it add up to less
    than p, so the most likely token always stays."""
    sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_above >= p
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)  # back to vocabulary order
    return probs.masked_fill(drop, 0.0)


def min_p_filter(probs, min_p):
    """Zero every token less likely than min_p times the row's likeliest (Nguyen et al.
    2024, "min-p sampling"): keep x_i when P(x_i) >= min_p * max_j P(x_j). The bar moves
    with the model's confidence, as top-p's does, but never cuts the likeliest token and
    needs no sort. A ratio of probabilities, so the same before or after top-p's cut."""
    return probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None, min_p=None):
    """Pick one token per row of logits (B, V); returns a LongTensor (B, 1).

    Never modifies `logits`. `generator`, a torch.Generator, makes draws reproducible."""
    check_sampling_args(temperature, top_k, top_p, min_p)
    if temperature == 0:
        # greedy: no softmax, no random draw. NaN would win argmax, so it is excluded first.
        return without_nan(logits).argmax(dim=-1, keepdim=True)
    probs = probabilities(logits, temperature, top_k, top_p, min_p)
    # multinomial does not need the row to sum to 1, so no renormalisation after top-p
    return torch.multinomial(probs, num_samples=1, generator=generator)


def probabilities(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """The distribution sample() draws from, for temperature > 0: fp32 weights (..., V), in
    proportion to each token's probability (after top-p they sum to less than 1: divide by
    the sum for probabilities). Speculative decoding (generation/speculative.py) needs it
    as numbers, not as a draw."""
    # fp32 cannot hold every positive Python float: a temperature under ~1e-45 rounds to 0
    # (0/0 = NaN at the row's max: multinomial raised), one over ~3.4e38 to inf (-inf/inf =
    # NaN at excluded tokens, which were then sampled). Clamped to fp32's normal range,
    # they act as the extremes they are: greedy-like, or uniform over the allowed tokens.
    temperature = min(max(temperature, FP32.tiny), FP32.max)
    logits = clean_logits(logits) / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        probs = top_p_filter(probs, top_p)
    if min_p:
        probs = min_p_filter(probs, min_p)
    return probs


def sample_with_noise(logits, noise, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """sample()'s draw without torch.multinomial, for a compiled graph (only tensor
    operations, no branch on values): noise (B, V) holds independent Exp(1) numbers E_i,
    and the token is the argmax of p_i / E_i. The same distribution: E_i / p_i is
    exponential with rate p_i, and the first of independent exponential clocks to ring is
    clock i with probability p_i / sum_j p_j. The caller draws the noise
    (noise.exponential_(generator=...)), so a seed still fixes the text. Returns (B, 1)."""
    if temperature == 0:
        return without_nan(logits).argmax(dim=-1, keepdim=True)
    return (probabilities(logits, temperature, top_k, top_p, min_p) / noise).argmax(dim=-1, keepdim=True)


def sample_rows_with_noise(logits, gumbel, temperature):
    """sample_with_noise's draw for a batch whose rows have temperatures of their own:
    temperature (B,) float32, 0 for a greedy row (whose noise is ignored). The noise comes
    as gumbel (B, V) = -log(E), Gumbel(0, 1) numbers made from the Exp(1) ones: the log of
    p_i / E_i is log p_i + G_i, so the same token is the argmax of logits / T + G (log p
    is logits / T less a constant of the row), with no softmax to compute and the log
    taken where the noise is drawn. Returns (B,). No top-k or top-p: per row, those need a
    sort of the vocabulary, which a step should not pay for rows that do not ask (the
    serving engine draws such rows with sample()). Tensors only, so one compiled graph
    serves any mix of settings."""
    if not torch.compiler.is_compiling() and not (temperature > 0).any():
        return without_nan(logits).argmax(dim=-1)  # run eagerly, an all-greedy batch is this
    x = clean_logits(logits)  # each row's max at 0: a tiny temperature cannot overflow it
    # the same clamp as probabilities(): past float32's normal range a temperature acts as
    # its extreme (one that rounded to 0 in float32 is greedy here)
    t = temperature.clamp(FP32.tiny, FP32.max)[:, None]                 # (B, 1)
    return torch.where(temperature[:, None] > 0, x / t + gumbel, x).argmax(dim=-1)


# ---------------------------------------------------------------------------- logits processors
# Each takes logits (B, V) and per-row settings, and returns new logits (the input is never
# changed). A row that does not ask for a processor is given its neutral value (penalty 1,
# bias 0, nothing banned), which leaves its logits exactly as they were.

def ban(logits, banned):
    """Tokens a row may not take: banned (B, V) bool gets -inf, so no temperature or filter
    can bring it back. What bans: tokens outside allowed_token_ids, the last token of a bad
    word whose other tokens the text ends with, the end of text before min_tokens, and a
    grammar's mask (generation/structured.py: every token that would break it)."""
    return logits.masked_fill(banned, float("-inf"))


def add_bias(logits, bias):
    """OpenAI's logit_bias: z_i' = z_i + b_i, bias (B, V) (b_i in [-100, 100]; -100 all but
    bans a token, +100 all but forces it)."""
    return logits + bias


def repetition_penalty(logits, seen, penalty):
    """The repetition penalty of CTRL (Keskar et al. 2019), as transformers and llama.cpp
    apply it: every token already in the text (prompt or output: seen (B, V) bool) is made
    less likely by penalty (B, 1), r > 1:

        z_i' = z_i / r   if z_i > 0        z_i' = z_i * r   if z_i <= 0      (i seen)

    Dividing a negative logit would raise it, hence the two cases. Multiplicative: a token
    is penalised the same once seen, however often."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def presence_frequency_penalty(logits, counts, presence, frequency):
    """OpenAI's additive penalties, over the output only: counts (B, V), how often each
    token has been generated; presence and frequency (B, 1):

        z_i' = z_i - c_i * frequency - [c_i > 0] * presence

    Frequency grows with every repeat; presence is paid once. Negative values encourage
    repeats."""
    return logits - counts * frequency - (counts > 0) * presence
