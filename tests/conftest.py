"""Shared fixtures: tiny models (fast on 2 cores) and a byte-level tokenizer, so the tests
need neither the network nor the bundled checkpoint unless they are about it."""

import io
import os

# One thread for torch in the tests and in the scripts they start. Tiny models gain nothing
# from a second one, and when the machine runs anything else OpenMP's threads wait for each
# other at every operation: a 32-wide Linear took 8 ms instead of microseconds, and the
# suite several times as long. Set before torch is imported, so it holds everywhere.
os.environ["OMP_NUM_THREADS"] = "1"
import runpy
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # in case torch was imported first (a plugin): see above

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from base_model import GPTConfig  # noqa: E402
from plumbing.checkpoint import save_checkpoint  # noqa: E402
from generation import compiled_step, step_cache  # noqa: E402
from kv_cache import KVCacheGPT  # noqa: E402
from plumbing.tokenizer import encoding_from_spec  # noqa: E402
from serving.requests import SamplingParams  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--screenshot", metavar="PNG", help="tests/test_web_page.py: save a picture "
                     "of the page there (docs/serving-page.png is the one docs/serving.md shows)")


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Small shapes that still cover what matters: several heads, a non-power-of-two head count,
# no biases, a context short enough to overflow in tests.
TINY_CONFIGS = [
    GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32),
    GPTConfig(context_len=48, vocab_size=300, n_layer=3, n_head=3, n_embd=48, bias=False),
]


def byte_tokenizer_spec():
    """Every byte is a token, plus <|endoftext|>: round-trips any text, needs no training."""
    return {"name": "bytes", "pat_str": GPT2_PATTERN,
            "mergeable_ranks": [bytes([i]) for i in range(256)],
            "special_tokens": {"<|endoftext|>": 256}}


def byte_tokenizer():
    """byte_tokenizer_spec as a tiktoken Encoding, through the loaders' own validation."""
    return encoding_from_spec(byte_tokenizer_spec(), "bytes")


def random_prompts(lengths, seed=0, vocab=256):
    """Prompts of these lengths, token ids below vocab (256: the byte tokenizer's bytes)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_model(config, seed=0, cls=KVCacheGPT):
    torch.manual_seed(seed)
    return cls(config).eval()


def spread_out(model, std):
    """model with its matrices drawn again at a larger std: random tiny models give nearly
    equal logits, and greedy text then flips between near-ties; spread out, it does not."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


@pytest.fixture(params=range(len(TINY_CONFIGS)), ids=["4heads", "3heads-nobias"])
def config(request):
    return TINY_CONFIGS[request.param]


# for a serve.py the tests start as a process: no child building the lone request's compiled
# step in the background (serving/background_build.py), a minute of CPU for a server that
# lives seconds (tests/test_lone_step.py and test_compile_cache.py test the build)
NO_BACKGROUND_BUILD = {step_cache.OFF_VARIABLE: "1"}


@pytest.fixture(autouse=True)
def session_step_cache(tmp_path_factory, monkeypatch):
    """The compiled steps the tests build are kept in one temporary folder for the whole
    session, never in the user's cache (~/.cache): a later test building the same step
    loads it (step_cache.py). A test that turns the cache off (generate.py
    --no-compile-cache sets the variable) turns it off for itself only."""
    monkeypatch.setenv(step_cache.FOLDER_VARIABLE, str(tmp_path_factory.getbasetemp() / "compiled-steps"))
    monkeypatch.delenv(step_cache.OFF_VARIABLE, raising=False)


@pytest.fixture
def tiny_ckpt(tmp_path):
    """A checkpoint file of a tiny random model carrying the byte tokenizer."""
    path = tmp_path / "tiny.pt"
    save_checkpoint(path, tiny_model(TINY_CONFIGS[0]), byte_tokenizer_spec())
    return path


# ---------------------------------------------------------------------------- scripts in-process

def run_script(script, *args, stdin=""):
    """`python script args`, run in this process, with stdin as its standard input: a
    subprocess.CompletedProcess with the exit status, stdout and stderr (text). A fresh
    interpreter and `import torch` cost 2-3 s per run, more than most runs' own work. The
    script's code runs as in a process of its own (its __main__ block, plumbing.script.run's one-line
    errors and exit statuses); what only a process has (signals, closed descriptors, the
    terminal, a timeout) is tested with one.

    The streams are a pipe's: UTF-8, stdout strict (plumbing/script.py relaxes it), stderr
    backslashreplace. Bytes in args arrive as a process gets bytes that are not UTF-8
    (surrogates). Not captured: what C code writes to descriptors 1 and 2 itself. An
    exception the script lets out (a traceback and status 1 in a process) fails the test
    there. Put back afterwards: argv, the streams, torch's random state (the scripts seed
    it), the warning filters."""
    argv = [str(ROOT / script), *(os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args)]
    streams = (text_stream(stdin.encode("utf-8")), text_stream(), text_stream(errors="backslashreplace"))
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    sys.argv = argv
    sys.stdin, sys.stdout, sys.stderr = streams
    try:
        with torch.random.fork_rng(), warnings_as_at_start_up():
            try:
                runpy.run_path(argv[0], run_name="__main__")
                returncode = 0
            except SystemExit as e:  # the scripts exit with a number (plumbing.script.run, argparse)
                returncode = e.code or 0
        stdout, stderr = (read_back(stream) for stream in streams[1:])
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def text_stream(data=b"", errors="strict"):
    """A UTF-8 text stream over bytes in memory, with the .buffer that scripts read from."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors)


def read_back(stream):
    """What was written to a text_stream, decoded strictly: bytes that are not UTF-8 fail."""
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8")


@contextmanager
def warnings_as_at_start_up():
    """Warnings as a script started by `python` meets them: Python's default filters (pytest's
    show more, DeprecationWarning from libraries too), printed on sys.stderr (pytest collects
    them for its summary instead, where a test of the one-line errors would miss them)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()  # then the defaults: python -c "import warnings; print(warnings.filters)"
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category, append=True)
        warnings.showwarning = print_warning
        yield


def print_warning(message, category, filename, lineno, file=None, line=None):
    """warnings.showwarning as Python's own, on the sys.stderr of the moment (the run's)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@pytest.fixture
def builds(monkeypatch):
    """build_program without the C++: the exported graph, run by Python. Returns the list of
    the programs built, to count them. Its stand-in cache holds what this test built: a
    program asked for only if cached (build_missing=False) is found once one was built."""
    built = []

    def run_exported(program, example_inputs, dynamic_shapes=None, build_missing=True):
        if not build_missing and not built:
            raise compiled_step.NotCached
        module = compiled_step.export_program(program, example_inputs, dynamic_shapes).module()
        built.append(program)

        def run(inputs):  # a list of the outputs, as the library's boxed_run gives them
            outputs = module(*inputs)
            return list(outputs) if isinstance(outputs, tuple) else [outputs]
        return run
    monkeypatch.setattr(compiled_step, "build_program", run_exported)
    return built


# ---------------------------------------------------------------------------- the serving engine

def run(engine, prompts, **params):
    """The engine's new tokens for each prompt, every request added at once and run to the end."""
    requests = [engine.add_request(p, SamplingParams(**params)) for p in prompts]
    engine.run_until_done()
    return [r.tokens[r.prompt_len:] for r in requests]


def assert_pool_is_whole(engine):
    """Every block back in the pool, no sequence left: nothing leaked."""
    pool = engine.pool
    assert len(pool.free) == pool.num_blocks and not any(pool.ref_count)
    assert not engine.scheduler.running and not engine.scheduler.waiting
