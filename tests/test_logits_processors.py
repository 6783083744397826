"""Logits processors: sample.py's formulas, generation/logits_processors.py's per-row state
(prompt, output, proposals ahead), the loop and the serving engine with processors on some
rows only, and parity with transformers' generate() on the same random GPT-2.

Tolerances: the formulas are exact float32 arithmetic on small numbers, compared exactly;
the transformers comparisons are token equality over 50 greedy tokens (the two forwards
agree to ~1e-5, tests/test_hf.py, and these seeds have no argmax near-tie)."""

import pytest
import torch

from base_model import GPTConfig
from conftest import byte_tokenizer, run_script, tiny_model
from generation.logits_processors import Processors, RowProcessing, bad_word_ids
from generation.loop import generate_tokens
from sample import min_p_filter, presence_frequency_penalty, probabilities, repetition_penalty
from serving.engine import Engine
from serving.requests import SamplingParams

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
EOT = 256  # the byte tokenizer's end of text


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=5)


def test_the_formulas():
    z = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    seen = torch.tensor([[True, True, False, True]])
    # divide positive, multiply negative, only where seen
    assert repetition_penalty(z, seen, 2.0).tolist() == [[1.0, -4.0, 1.0, 0.0]]
    counts = torch.tensor([[3, 0, 1, 0]])
    assert presence_frequency_penalty(z, counts, 0.5, 0.25).tolist() == [[0.75, -2.0, 0.25, 0.0]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert (min_p_filter(probs, 0.5) > 0).tolist() == [[True, True, False, False]]  # >= 0.25 stays
    assert (probabilities(z, 1.0, min_p=0.3) > 0).tolist() == [[True, False, True, False]]


def test_row_state_bad_words_min_tokens_allowed_and_bias():
    row = RowProcessing(Processors(bad_words=((5,), (1, 2)), min_tokens=2, end_ids=(EOT,),
                                   allowed_token_ids=(1, 2, 5, 7, EOT), logit_bias=((7, 3.0),)),
                        prompt=[9, 1])
    out = row(torch.zeros(1, 260))[0]
    allowed = (~torch.isneginf(out)).nonzero()[:, 0].tolist()
    assert allowed == [1, 7]        # 5 a bad word; 2 ends "1 2" after the prompt's 1; EOT before 2 tokens
    assert out[7] == 3.0            # the bias
    row.accept([7, 7])              # two tokens: the end of text may come, 2 no longer follows a 1
    out = row(torch.zeros(1, 260))[0]
    assert (~torch.isneginf(out)).nonzero()[:, 0].tolist() == [1, 2, 7, EOT]


def test_ahead_is_the_same_as_taking_the_tokens():
    """What speculative verification relies on: position i processed with proposals ahead
    equals the row processed after taking them."""
    p = Processors(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.6,
                   bad_words=((3, 4),), min_tokens=3, end_ids=(0,))
    logits = torch.randn(4, 260, generator=torch.Generator().manual_seed(0))
    ahead = [3, 3, 8]
    together = RowProcessing(p, [1, 2])(logits, ahead=ahead)
    for i in range(4):
        row = RowProcessing(p, [1, 2])
        row.accept(ahead[:i])
        assert torch.equal(together[i], row(logits[i:i + 1])[0]), i


def test_bad_words_as_vllm_reads_them():
    tok = byte_tokenizer()
    assert bad_word_ids(["ab"], tok) == ((97, 98), (32, 97, 98))  # as written, and after a space


def test_a_batch_keeps_rows_without_processors_unchanged(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    plain = generate_tokens(model, prompts, 30, temperature=0)
    p = Processors(repetition_penalty=1.8, bad_words=((int(plain[1, 3]),),))
    mixed = generate_tokens(model, prompts, 30, temperature=0, processors=[None, p])
    assert mixed[0].tolist() == plain[0].tolist()
    assert mixed[1].tolist() != plain[1].tolist()
    assert int(plain[1, 3]) not in mixed[1].tolist()
    # the repetition penalty does its job: fewer repeated tokens
    assert len(set(mixed[1].tolist())) > len(set(plain[1].tolist()))


def test_a_row_left_no_token_ends(model):
    p = Processors(allowed_token_ids=(EOT,), min_tokens=5, end_ids=(EOT,))
    out = generate_tokens(model, [[1, 2]], 10, temperature=0, processors=p)
    assert out.tolist() == [[-1] * 10]


def test_the_engine_per_request(model):
    tok = byte_tokenizer()
    engine = Engine(model, tok, num_blocks=64, attention="gather")
    texts = {}
    on_output = lambda r, o: texts.__setitem__(id(r), texts.get(id(r), "") + o.text)  # noqa: E731
    plain = engine.add_request([65, 66], SamplingParams(max_tokens=20, temperature=0, stop_at_eot=False), on_output)
    banned = engine.add_request([65, 66], SamplingParams(max_tokens=20, temperature=0, stop_at_eot=False,
                                                         bad_words=("Q",), repetition_penalty=1.5), on_output)
    stuck = engine.add_request([65], SamplingParams(max_tokens=20, temperature=0, min_tokens=3,
                                                    allowed_token_ids=(EOT,)), on_output)
    engine.run_until_done()
    alone = generate_tokens(model, [[65, 66]], 20, temperature=0)[0].tolist()
    assert texts[id(plain)] == tok.decode(alone)  # a neighbour with processors changes nothing
    assert "Q" not in texts[id(banned)] and texts[id(banned)] != texts[id(plain)]
    assert (stuck.finish_reason, texts[id(stuck)]) == ("length", "")
    for bad, message in [(dict(logit_bias=((999, 1.0),)), "logit_bias"), (dict(min_p=1.5), "min_p"),
                         (dict(presence_penalty=3), "presence_penalty"), (dict(min_tokens=99), "min_tokens"),
                         (dict(allowed_token_ids=()), "allowed_token_ids")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request([65], SamplingParams(**bad))


def test_generate_py_flags_and_one_line_errors(tiny_ckpt):
    done = run_script("generate.py", "--ckpt", tiny_ckpt, "--prompt", "ab", "--temperature", "0",
                      "--max-new-tokens", "8", "--bad-words", "a", "--min-p", "0.1", "--no-stream")
    assert done.returncode == 0, done.stderr
    assert "a" not in done.stdout.removeprefix("ab")
    for flags in (["--logit-bias", "1:101"], ["--allowed-token-ids", "9999"], ["--min-p", "2"],
                  ["--repetition-penalty", "0"], ["--no-cache", "--min-tokens", "2"]):
        failed = run_script("generate.py", "--ckpt", tiny_ckpt, "--prompt", "ab", *flags)
        assert failed.returncode == 2 and failed.stderr.count("\n") <= 2, (flags, failed.stderr)
        assert "error: " in failed.stderr and "Traceback" not in failed.stderr


# ---------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_hf import make_hf_dir
    from kv_cache import CACHED_MODELS
    from plumbing.hf import load_hf_model
    path = tmp_path_factory.mktemp("hf")
    hf = make_hf_dir(path, n_embd=32, n_head=2, n_layer=2, fmt="safetensors", attn="eager")
    ours, _ = load_hf_model(CACHED_MODELS, path, report=lambda *_: None)
    return hf, ours


@pytest.mark.parametrize("name, theirs, ours", [
    ("repetition", dict(repetition_penalty=1.4), Processors(repetition_penalty=1.4)),
    ("bad words", dict(bad_words_ids=[[193], [138, 138]]), Processors(bad_words=((193,), (138, 138)))),
    ("logit bias", dict(sequence_bias={(40,): 4.0, (7,): -3.0}), Processors(logit_bias=((40, 4.0), (7, -3.0)))),
])
@torch.no_grad()
def test_greedy_with_a_processor_equals_transformers(hf_and_ours, name, theirs, ours):
    hf, model = hf_and_ours
    prompt = torch.tensor([[40, 17, 23, 5, 40, 9]])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=50, eos_token_id=None, pad_token_id=0, **theirs)[0, 6:]
    mine = generate_tokens(model, prompt.tolist(), 50, temperature=0, processors=ours)[0]
    plain = generate_tokens(model, prompt.tolist(), 50, temperature=0)[0]
    assert mine.tolist() == expected.tolist()
    assert mine.tolist() != plain.tolist()  # the processor changed the text: the test can fail


def test_min_p_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import MinPLogitsWarper
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1)) * 3
    theirs = MinPLogitsWarper(min_p=0.1)(None, logits.clone())
    kept = probabilities(logits, 1.0, min_p=0.1) > 0
    assert torch.equal(kept, ~torch.isneginf(theirs))
