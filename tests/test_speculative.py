"""Speculative decoding (generation/speculative.py) and the rollback it needs from every
cache kind (generation/rows.py's Rows.rollback).

Greedy: token equality with plain decoding is exact, for every proposer, cache kind and
batch; the verification pass computes the same logits in one (B, K + 1) matmul instead
of K + 1 steps (~1e-6 apart, as in test_batch.py), and argmax flips only at near-ties,
which these seeds lack.

Sampling: the distribution test below compares the first L tokens of N samples with the
model's exact distribution over all V^L sequences, computed by enumeration with
sample.probabilities (what plain sampling draws from). Pearson's chi-square over the cells
with at least 5 expected (the rest pooled into one cell, so no probability is dropped)
has, for a sampler that is exact, a chi-square distribution with (cells - 1) degrees of
freedom; a check fails when its p-value is below 1e-4, so an exact sampler fails a given
check with probability 1e-4 (about 1e-3 over the whole file), and the seeds are fixed: a
result does not change from run to run. The same check on the tempting wrong rule (draw
from p instead of the residual after a rejection) gives p-values far below 1e-4: the test
can fail. Logits tolerance for the rollback: 1e-4 absolute (fp32), as in test_batch.py."""

import itertools
import json

import pytest
import torch

from base_model import GPTConfig
from conftest import random_prompts, run_script, tiny_model
from generation import loop, speculative
from generation.loop import Generation, GenerationStats, generate_tokens, left_pad
from generation.logits_processors import Processors, RowProcessing
from generation.rows import Rows
from generation.speculative import DraftModel, PromptLookup
from plumbing.checkpoint import BUNDLED
from sample import probabilities

ATOL = 1e-4
CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
DRAFT = GPTConfig(context_len=24, vocab_size=260, n_layer=1, n_head=2, n_embd=16)  # a shorter context


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=31)


def proposers(model):
    return {"lookup": PromptLookup(3), "draft": DraftModel(tiny_model(DRAFT, seed=32)),
            "self-draft": DraftModel(model)}  # the model as its own draft: nearly all accepted


# ---------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("name, k, kind", [("lookup", 4, None), ("lookup", 4, "cat"),
                                           ("lookup", 4, "int8"), ("lookup", 1, None),
                                           ("draft", 3, None), ("self-draft", 8, None)])
def test_greedy_equals_plain_decoding(model, name, k, kind):
    # different lengths (left padding; a repeating one, where lookup finds much), 200 tokens:
    # past the 64-token context, so every row reprefills at its own steps
    prompts = random_prompts([1, 9, 30]) + [[7, 8, 9, 10] * 5]
    plain = generate_tokens(model, prompts, 200, temperature=0, cache_kind=kind)
    stats = GenerationStats()
    fast = generate_tokens(model, prompts, 200, temperature=0, cache_kind=kind,
                           speculate=k, proposer=proposers(model)[name], stats=stats)
    assert torch.equal(fast, plain)
    assert stats.reprefills > 0 and 0 < stats.accepted <= stats.proposed
    if name != "draft":  # (a random draft is too poor a guesser to save passes)
        assert stats.forward_passes < 1 + 199 + stats.reprefills  # plain decoding's passes
    if name == "self-draft":
        assert stats.accepted > 0.9 * stats.proposed


def test_num_samples_and_rows_that_finish_mid_step(model):
    """Rows of one prompt share a prefill; a row finished by the caller in the middle of a
    step's tokens gets none of the rest, and the others go on unchanged."""
    prompt = [[5, 6, 7, 8] * 6]
    plain = generate_tokens(model, prompt, 60, temperature=0, num_samples=3)
    generation = Generation(model, prompt, 60, temperature=0, num_samples=3, speculate=6,
                            proposer=PromptLookup(2))
    got = {0: [], 1: [], 2: []}
    for rows, tokens in generation:
        for row, token in zip(rows, tokens.tolist()):
            got[row].append(token)
            if row == 1 and len(got[1]) == 7:
                generation.finish(1)
    assert got[0] == got[2] == plain[0].tolist()
    assert got[1] == plain[1, :7].tolist()
    assert generation.stats.accepted > 0


@pytest.mark.parametrize("name, graphs", [("lookup", 1), ("draft", 2)])
def test_compiled_verification_is_built_once_and_the_same_tokens(builds, name, graphs, monkeypatch):
    """With compile, every verification feeds K + 1 columns (filler where a row has fewer
    proposals) through one graph, rollback moving the rows of its buffer, the buffer grown
    8 columns at a time in between; the draft decodes through a graph of its own; near the
    end of the context the step is eager."""
    monkeypatch.setattr(loop, "CACHE_GROWTH", 8)
    model = tiny_model(CONFIG, seed=31)  # its own: the module's model may hold a build already
    prompts = random_prompts([3, 20]) + [[1, 2, 3] * 4]
    plain = generate_tokens(model, prompts, 150, temperature=0)
    stats = GenerationStats()
    fast = generate_tokens(model, prompts, 150, temperature=0, compile=True, speculate=4,
                           proposer=proposers(model)[name], stats=stats)
    assert torch.equal(fast, plain)
    assert len(builds) == graphs and stats.accepted > 0


def test_needs_speculate_and_a_proposer_together(model):
    with pytest.raises(ValueError, match="speculate"):
        Generation(model, [[1]], 5, speculate=3)
    with pytest.raises(ValueError, match="speculate"):
        Generation(model, [[1]], 5, proposer=PromptLookup(2))


def test_a_draft_proposes_among_the_models_tokens(model):
    """A draft's embedding table may be larger than the model's (padding rows): it proposes
    below the model's size (or vocab_limit), and sampling stays exact in shape. One smaller
    than the tokens the model samples from is refused: q could not cover p."""
    padded = DraftModel(tiny_model(GPTConfig(**{**vars(DRAFT), "vocab_size": 300}), seed=33))
    prompts = random_prompts([4, 11])
    for options in (dict(temperature=0), dict(temperature=1.0, generator=torch.Generator())):
        fast = generate_tokens(model, prompts, 30, speculate=3, proposer=padded, **options)
        assert fast.shape == (2, 30) and int(fast.max()) < CONFIG.vocab_size
    plain = generate_tokens(model, prompts, 30, temperature=0)
    assert torch.equal(generate_tokens(model, prompts, 30, temperature=0, speculate=3, proposer=padded),
                       plain)
    small = DraftModel(tiny_model(GPTConfig(**{**vars(DRAFT), "vocab_size": 200}), seed=34))
    with pytest.raises(ValueError, match="vocabulary of 200 tokens is smaller than the model's 260"):
        generate_tokens(model, prompts, 5, temperature=0, speculate=3, proposer=small)
    # with vocab_limit (a tokenizer of 200 tokens, within both tables) the small draft does
    prompts = [[t % 200 for t in p] for p in prompts]
    assert torch.equal(generate_tokens(model, prompts, 30, temperature=0, speculate=3, proposer=small,
                                       vocab_limit=200),
                       generate_tokens(model, prompts, 30, temperature=0, vocab_limit=200))


def test_prompt_lookup_proposes_what_followed_and_continues_a_repeat():
    lookup = PromptLookup(2)
    lookup.start([[1, 2, 3, 9, 2, 3, 4, 5, 6, 2, 3], [7, 8, 7, 8], [4]])
    proposals = lookup.propose(4)
    assert proposals.tokens[0].tolist() == [4, 5, 6, 2]  # '2 3' last followed by 4 5 6 2 ...
    assert proposals.tokens[1].tolist() == [7, 8, 7, 8]  # a repeat runs into itself
    assert proposals.counts.tolist() == [4, 4, 0]         # nothing before a lone token


# ---------------------------------------------------------------------------- distribution

V, L, N = 4, 5, 20000  # the first L tokens of N samples; V^L = 1024 cells
PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup has proposals to make


@pytest.fixture(scope="module")
def small():
    model = tiny_model(GPTConfig(context_len=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16), seed=41)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # sharper than a random model's: acceptance varies
    draft = tiny_model(GPTConfig(context_len=16, vocab_size=V, n_layer=1, n_head=2, n_embd=16), seed=42)
    return model, draft


def exact_distribution(model, processors=None, length=L, **sampling):
    """P(first L tokens = s) for every s in V^L (lexicographic order), by enumeration; with
    processors, position i of s processed as the row is after s[:i]."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=length)))   # (V^L, L)
    idx = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = model(idx)[0][:, len(PROMPT) - 1:-1]                        # (V^L, L, V)
    if processors is not None:
        logits = torch.stack([RowProcessing(processors, PROMPT)(row, ahead=seq[:-1].tolist())
                              for row, seq in zip(logits, seqs)])
    p = probabilities(logits, **sampling)
    p = p / p.sum(dim=-1, keepdim=True)
    return p.gather(-1, seqs[..., None])[..., 0].prod(dim=-1).double()


def chi_square_p_value(samples, expected_p):
    """Pearson's test of samples (N, L) against the cell probabilities expected_p."""
    length = samples.size(1)
    cells = (samples * V ** torch.arange(length - 1, -1, -1)).sum(dim=1)
    observed = torch.bincount(cells, minlength=V ** length).double()
    expected = expected_p * samples.size(0)
    big = expected >= 5
    if expected[~big].sum() == 0:  # cells no sample may reach (min-p, bans): pooled, none there
        return 0.0 if observed[~big].sum() else chi_square_tail(observed[big], expected[big])
    observed = torch.cat([observed[big], observed[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    return chi_square_tail(observed, expected)


def chi_square_tail(observed, expected):
    chi2 = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1.0, dtype=torch.double)
    return torch.special.gammaincc(dof / 2, chi2 / 2).item()  # P(chi2(dof) >= chi2)


def samples_of(model, seed, n=N, length=L, **options):
    return generate_tokens(model, [PROMPT], length, num_samples=n,
                           generator=torch.Generator().manual_seed(seed), **options)


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8),
            dict(temperature=1.0, min_p=0.2)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.7-topk3", "t1.3-topp0.8", "t1-minp0.2"])
def test_sampling_keeps_the_models_distribution(small, sampling):
    model, draft = small
    expected = exact_distribution(model, **sampling)
    assert chi_square_p_value(samples_of(model, 1, **sampling), expected) > 1e-4  # plain: the reference
    for seed, proposer in enumerate([PromptLookup(2), DraftModel(draft)], start=2):
        stats = GenerationStats()
        samples = samples_of(model, seed, speculate=3, proposer=proposer, stats=stats, **sampling)
        assert chi_square_p_value(samples, expected) > 1e-4, type(proposer).__name__
        assert 0 < stats.accepted < stats.proposed  # both branches of the rule were taken


# Processors that depend on the text so far (the penalties, a two-token bad word, min_tokens:
# token 0 is this test's end of text), so that each position of a verification must be
# processed as if the proposals before it had been taken. Each row is processed in Python,
# so fewer samples of fewer tokens: 3 tokens (64 cells) of 4,000 samples.
PROCESSORS = Processors(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
                        logit_bias=((2, 1.0),), bad_words=((3, 3),), min_tokens=2, end_ids=(0,))


def test_sampling_with_processors_keeps_the_processed_distribution(small):
    model, draft = small
    expected = exact_distribution(model, PROCESSORS, length=3, temperature=1.0)
    options = dict(n=4000, length=3, temperature=1.0, processors=PROCESSORS)
    assert chi_square_p_value(samples_of(model, 1, **options), expected) > 1e-4  # plain: the reference
    for seed, proposer in enumerate([PromptLookup(2), DraftModel(draft)], start=2):
        stats = GenerationStats()
        samples = samples_of(model, seed, speculate=2, proposer=proposer, stats=stats, **options)
        assert chi_square_p_value(samples, expected) > 1e-4, type(proposer).__name__
        assert 0 < stats.accepted < stats.proposed


def test_the_distribution_test_catches_a_wrong_rule(small, monkeypatch):
    """Drawing from p after a rejection, instead of the residual max(0, p - q), gives the
    proposed tokens too often: the same check must fail it."""
    model, draft = small
    expected = exact_distribution(model, temperature=1.0)
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    for proposer in (PromptLookup(2), DraftModel(draft)):
        samples = samples_of(model, 7, temperature=1.0, speculate=3, proposer=proposer)
        assert chi_square_p_value(samples, expected) < 1e-4


# ---------------------------------------------------------------------------- rollback

@pytest.mark.parametrize("kind", ["cat", None, "bfloat16", "int8", "int4"])
def test_rollback_per_row_forgets_exactly_what_was_fed_after(model, kind):
    """Rows of a padded batch roll back by different amounts; what follows gives each row
    the logits of a cache that never saw the forgotten tokens, and the history moves with
    the cache: each row's tokens stay right-aligned."""
    prompts = random_prompts([3, 9, 6], seed=5)
    extra = random_prompts([5, 5, 5], seed=6)
    keep = [5, 1, 3]                     # of the 5 extra tokens, per row
    after = random_prompts([2, 2, 2], seed=7)
    tokens, pad = left_pad(prompts, CONFIG.context_len, "cpu")
    rows = Rows(model.new_cache(3, kind, pad), 3, CONFIG.context_len, "cpu")
    with torch.no_grad():
        for fed in (tokens, torch.tensor(extra)):
            rows.record(fed)
            model(fed, rows.cache)
        held = torch.tensor([len(p) + 5 for p in prompts])
        rows.rollback(held - 5 + torch.tensor(keep))
        assert rows.length == tokens.size(1) + 5 and rows.cache.pad.tolist() == [6 + 0, 0 + 4, 3 + 2]
        for b in range(3):
            kept = prompts[b] + extra[b][:keep[b]]
            assert rows.history[b, rows.length - len(kept):rows.length].tolist() == kept
        logits = model(torch.tensor(after), rows.cache)[0]
        for b in range(3):
            alone = model.new_cache(1, kind)
            model(torch.tensor([prompts[b] + extra[b][:keep[b]]]), alone)
            expected = model(torch.tensor([after[b]]), alone)[0]
            assert (logits[b] - expected[0]).abs().max() < ATOL


def test_rollback_refuses_to_keep_what_a_row_does_not_hold(model):
    rows = Rows(model.new_cache(2, pad=torch.tensor([0, 2])), 2, CONFIG.context_len, "cpu")
    with torch.no_grad():
        model(torch.zeros(2, 4, dtype=torch.long), rows.cache)
    with pytest.raises(ValueError, match="rollback"):
        rows.rollback(torch.tensor([4, 3]))  # row 1 holds 2 positions
    rows.rollback(torch.tensor([0, 2]))       # forgetting everything is allowed
    assert rows.length == 4 and rows.cache.pad.tolist() == [4, 2] and rows.pad.tolist() == [4, 2]


# ---------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conftest import byte_tokenizer_spec
    from plumbing.checkpoint import save_checkpoint
    d = tmp_path_factory.mktemp("spec")
    save_checkpoint(d / "model.pt", tiny_model(CONFIG, seed=31), byte_tokenizer_spec())
    save_checkpoint(d / "draft.pt", tiny_model(DRAFT, seed=32), byte_tokenizer_spec())
    return d


def run_generate(ckpt, *args):
    proc = run_script("generate.py", "--ckpt", ckpt / "model.pt", "--temperature", "0", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("proposer", [["--prompt-lookup", "2"], ["--draft", "{d}/draft.pt"]],
                         ids=["lookup", "draft"])
def test_generate_py_same_text_stop_strings_and_stats(ckpt, proposer):
    proposer = [a.replace("{d}", str(ckpt)) for a in proposer]
    prompts = ["--prompt", "abcabcabc", "--prompt", "x", "--max-new-tokens", "150"]
    plain = run_generate(ckpt, *prompts, "--ignore-eot").stdout
    stop = plain.split("abcabcabc", 1)[1][40:43]  # a stop string inside the first row's text
    args = [*prompts, f"--stop={stop}", "--json"]
    import json
    plain = json.loads(run_generate(ckpt, *args).stdout)
    fast = json.loads(run_generate(ckpt, *args, "--speculate", "4", *proposer).stdout)
    assert fast["texts"] == plain["texts"] and stop not in fast["texts"][0]
    spec = fast["stats"]["speculative"]
    assert plain["stats"]["speculative"] is None
    assert 0 <= spec["accepted"] <= spec["proposed"] and spec["verify_passes"] > 0
    assert fast["stats"]["forward_passes"] <= plain["stats"]["forward_passes"]
    stats = run_generate(ckpt, *prompts, "--speculate", "3", *proposer, "--stats").stderr
    assert "speculative:" in stats and "accepted" in stats


@pytest.mark.parametrize("source, extra", [("hf", []), ("ckpt", ["--kv-dtype", "int8"]),
                                           ("ckpt", ["--quantize", "int8"])],
                         ids=["hf-dirs", "kv-int8", "quantize-int8"])
def test_generate_py_with_hf_directories_a_quantized_cache_and_weights(ckpt, source, extra):
    """The draft as a Hugging Face directory beside the model's; the model's cache in int8;
    both models' weights in int8: the same greedy text as without --speculate."""
    if source == "hf":
        from export_hf import export
        for name in ("model", "draft"):
            if not (ckpt / name).exists():
                export(ckpt / f"{name}.pt", ckpt / name, report=lambda line: None)
        model, draft = ["--hf", ckpt / "model"], ckpt / "draft"
    else:
        model, draft = ["--ckpt", ckpt / "model.pt"], ckpt / "draft.pt"
    args = [*model, "--temperature", "0", "--prompt", "abcabcabc", "--max-new-tokens", "80",
            "--ignore-eot", *extra]
    plain = run_script("generate.py", *args)
    fast = run_script("generate.py", *args, "--speculate", "3", "--draft", draft, "--stats")
    assert plain.returncode == fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and "loaded draft" in fast.stderr


def test_the_bundled_model_and_its_bundled_draft():
    """What a fresh clone has: the bundled draft shares the bundled model's tokenizer, and
    both proposers give plain decoding's greedy text on the real pair."""
    draft = BUNDLED.parent.parent / "shakespeare-draft" / "ckpt.pt"
    args = ["--prompt", "ROMEO:", "--prompt", "First Witch:", "--temperature", "0",
            "--max-new-tokens", "48", "--ignore-eot", "--json"]
    plain = json.loads(run_script("generate.py", *args).stdout)
    for proposer in (["--prompt-lookup", "3"], ["--draft", draft]):
        assert_speculation_keeps_the_text(args, plain, proposer)


def assert_speculation_keeps_the_text(args, plain, proposer):
    """generate.py args (greedy, --json) with --speculate 4 and proposer gives plain (the
    same run's JSON without speculation) its texts, accepting some proposals, in fewer
    forward passes."""
    proc = run_script("generate.py", *args, "--speculate", "4", *proposer)
    assert proc.returncode == 0, proc.stderr
    fast = json.loads(proc.stdout)
    assert fast["texts"] == plain["texts"]
    spec = fast["stats"]["speculative"]
    assert 0 < spec["accepted"] <= spec["proposed"]
    assert fast["stats"]["forward_passes"] < plain["stats"]["forward_passes"]
