"""The compiled steps kept on disk (generation/step_cache.py): what the key tells apart, an
entry found again, a damaged or foreign one built again, a folder that is not private
refused, the size bound.

The cache's logic is checked with a stand-in build (a few bytes written as the "package",
read back as the "library"), so that a test takes milliseconds; one test builds for real
and loads the package again, as a second start does."""

import json
import os

import pytest
import torch

from base_model import GPTConfig
from conftest import run_script, tiny_model
from generation import compiled_step, step_cache
from generation.compiled_step import BUILD_OPTIONS, StepProgram
from kv_cache import KVCache
from weight_quant import quantize_model

CONFIG = GPTConfig(context_len=16, vocab_size=64, n_layer=1, n_head=2, n_embd=64)
GREEDY = {"temperature": 0.0, "top_k": None, "top_p": None}


def key_inputs(model, columns=16):
    """(the example inputs of a one-row step,)"""
    kv = torch.empty_like(KVCache(model.config, 1, "cpu", model.lm_head.weight.dtype, max_len=columns).kv)
    return ((torch.zeros(1, 1, dtype=torch.long), kv, torch.zeros(1, dtype=torch.long),
             torch.zeros(1, dtype=torch.long), torch.ones(1, 1)),)


def key_of(model, sampling=GREEDY, columns=16):
    """step_key of the step a one-row generation of model would build."""
    return step_cache.step_key(StepProgram(model, sampling, None), *key_inputs(model, columns), None, BUILD_OPTIONS)


def test_the_key_tells_apart_what_changes_the_library():
    key = key_of(tiny_model(CONFIG, seed=1))
    assert key_of(tiny_model(CONFIG, seed=1)) == key  # the same model in another process: a hit
    changed = tiny_model(CONFIG, seed=1)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1e-3  # one weight of 20,000
    others = [key_of(changed),
              key_of(tiny_model(CONFIG, seed=1).to(torch.bfloat16)),
              key_of(quantize_model(tiny_model(CONFIG, seed=1), "int8")),
              key_of(quantize_model(tiny_model(CONFIG, seed=1), "int4", group_size=32)),
              key_of(tiny_model(CONFIG, seed=1), {**GREEDY, "temperature": 0.8}),
              key_of(tiny_model(CONFIG, seed=1), columns=8)]
    assert all(other != key for other in others)
    # int4 in groups of 64 and of 32: the same kind of module, its setting tells them apart
    assert key_of(quantize_model(tiny_model(CONFIG, seed=1), "int4", group_size=64)) != others[3]


class StandIn:
    """A build that writes a few bytes as its package, and a load that reads them back:
    counts what each did."""

    def __init__(self, data=b"a library"):
        self.data, self.builds, self.loads = data, 0, 0

    def build(self, path):
        self.builds += 1
        path.write_bytes(self.data)

    def load(self, path):
        self.loads += 1
        return path.read_bytes()


KEY = {"weights": "abc", "torch": torch.__version__}


def entry(folder, key=KEY):
    """The package and manifest paths of key's entry."""
    digest = next(p.stem for p in folder.glob("*.json") if json.loads(p.read_text())["key"] == key)
    return folder / f"{digest}.pt2", folder / f"{digest}.json"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    folder = tmp_path / "steps"
    monkeypatch.setenv(step_cache.FOLDER_VARIABLE, str(folder))
    return folder


def test_a_second_start_loads_what_the_first_built(folder, capsys):
    stand_in = StandIn()
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load) == b"a library"
    assert "building the compiled step (once per model and machine" in capsys.readouterr().err
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load) == b"a library"
    assert stand_in.builds == 1 and "loaded from the cache" in capsys.readouterr().err
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert not list(folder.glob("building-*"))  # the scratch folder is gone
    step_cache.load_or_build({**KEY, "weights": "abd"}, stand_in.build, stand_in.load)
    assert stand_in.builds == 2  # another key, another entry


def test_the_off_switch_builds_every_time_and_keeps_nothing(folder, monkeypatch):
    monkeypatch.setenv(step_cache.OFF_VARIABLE, "1")
    stand_in = StandIn()
    for _ in range(2):
        step_cache.load_or_build(KEY, stand_in.build, stand_in.load)
    assert stand_in.builds == 2 and not folder.exists()


def test_a_lookup_only_builds_nothing_and_finds_what_a_build_kept(folder, monkeypatch):
    # build_missing=False (serve.py's default lone step): None, nothing built, until an
    # entry is there; with the cache off, never one
    stand_in = StandIn()
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load, build_missing=False) is None
    assert stand_in.builds == 0 and not step_cache.holds_entries()
    step_cache.load_or_build(KEY, stand_in.build, stand_in.load)
    assert step_cache.holds_entries()
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load, build_missing=False) == b"a library"
    assert step_cache.load_or_build({**KEY, "weights": "abd"}, stand_in.build, stand_in.load,
                                    build_missing=False) is None
    monkeypatch.setenv(step_cache.OFF_VARIABLE, "1")
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load, build_missing=False) is None
    assert stand_in.builds == 1


def fails_once(load):
    """load, but its first call raises as torch's loader does on a package it cannot read."""
    calls = []

    def load_after_a_failure(path):
        calls.append(path)
        if len(calls) == 1:
            raise RuntimeError("not a package")
        return load(path)
    return load_after_a_failure


@pytest.mark.parametrize("damage", ["package bytes", "package a link", "foreign manifest",
                                    "manifest not json", "fails to load"])
def test_a_damaged_or_foreign_entry_is_built_again_not_loaded(folder, damage):
    stand_in = StandIn()
    step_cache.load_or_build(KEY, stand_in.build, stand_in.load)
    package, manifest = entry(folder)
    if damage == "package bytes":
        package.write_bytes(b"a librarz")
    elif damage == "package a link":  # the same bytes, elsewhere: a link is never followed
        (folder.parent / "elsewhere.pt2").write_bytes(package.read_bytes())
        package.unlink()
        package.symlink_to(folder.parent / "elsewhere.pt2")
    elif damage == "foreign manifest":  # an entry of another key under this name
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "key": {"weights": "xyz"}}))
    elif damage == "manifest not json":
        manifest.write_text("{")
    else:  # intact, but torch's loader fails on it (a package it reads otherwise)
        stand_in.load = fails_once(stand_in.load)
    loads = stand_in.loads
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load) == b"a library"
    assert stand_in.builds == 2 and stand_in.loads == loads + 1  # loaded only once rebuilt
    assert not entry(folder)[0].is_symlink()


@pytest.mark.parametrize("unsafe", ["a symbolic link", "group-writable"])
def test_a_folder_that_is_not_private_is_refused_and_the_step_built_uncached(tmp_path, monkeypatch,
                                                                             capsys, unsafe):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if unsafe == "a symbolic link":
        folder = tmp_path / "steps"
        folder.symlink_to(real)
    else:
        folder = real
        os.chmod(real, 0o770)
    monkeypatch.setenv(step_cache.FOLDER_VARIABLE, str(folder))
    stand_in = StandIn()
    assert step_cache.load_or_build(KEY, stand_in.build, stand_in.load) == b"a library"
    err = capsys.readouterr().err
    assert f"warning: the compiled-step cache is not used: {folder} is" in err
    assert len([line for line in err.splitlines() if "warning" in line]) == 1
    assert not os.listdir(real)  # nothing written there, nothing read from it


def test_the_least_recently_used_entries_go_past_the_size_bound(folder, monkeypatch):
    monkeypatch.setattr(step_cache, "MAX_BYTES", 25)
    stand_in = StandIn(b"ten bytes!")
    keys = [{"weights": str(i)} for i in range(3)]
    for key in keys:  # 10 bytes each: two fit
        step_cache.load_or_build(key, stand_in.build, stand_in.load)
        os.utime(entry(folder, key)[1], (0, 0))  # as if last used long ago, in order
    assert stand_in.builds == 3
    stored = [json.loads(p.read_text())["key"] for p in folder.glob("*.json")]
    assert keys[0] not in stored and keys[2] in stored and len(stored) == 2
    assert len(list(folder.glob("*.pt2"))) == 2


def test_a_real_build_is_loaded_again_by_a_second_start(folder, capsys):
    """The real build (AOTInductor), then the same step of a fresh copy of the model (a
    second process's): loaded from the package, not built, the same logits."""
    tokens = torch.tensor([[5]])
    outputs = []
    with pytest.raises(compiled_step.NotCached):  # asked for only if cached: none is, yet
        compiled_step.compile_for(tiny_model(CONFIG, seed=3), KVCache(CONFIG, 1, "cpu", torch.float32),
                                  build_missing=False)
    assert not folder.exists()  # nothing built, no folder made
    for build_missing in (True, True, False):
        model = tiny_model(CONFIG, seed=3)  # a new model each time: nothing kept in memory
        cache = KVCache(CONFIG, 1, "cpu", torch.float32)
        step, _ = compiled_step.compile_for(model, cache, build_missing=build_missing)
        with torch.no_grad():
            outputs.append(step.decode(tokens, cache))
    err = capsys.readouterr().err
    assert err.count("building the compiled step") == 1 and err.count("loaded from the cache") == 2
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_a_library_reading_the_models_weights_is_keyed_by_their_layout_not_values(folder, capsys):
    """A quantized model's library holds no weights (compiled_step.reads_own_weights): its
    key names the weights' shapes, not their values, so a model of other weights and the
    same shape loads the package built for the first, and computes with its own weights
    (its eager logits, within the bf16 rounding of test_compiled's quantized build)."""
    first, other = (quantize_model(tiny_model(CONFIG, seed=seed), "int8") for seed in (3, 4))
    own_key = step_cache.step_key(StepProgram(first, GREEDY, None), *key_inputs(first), None, BUILD_OPTIONS,
                                  weights_inside=False)
    assert own_key == step_cache.step_key(StepProgram(other, GREEDY, None), *key_inputs(other), None,
                                          BUILD_OPTIONS, weights_inside=False)
    assert own_key != step_cache.step_key(StepProgram(quantize_model(tiny_model(CONFIG, seed=3), "int4"),
                                                      GREEDY, None), *key_inputs(first), None, BUILD_OPTIONS,
                                          weights_inside=False)
    tokens = torch.tensor([[5]])
    for model in (first, other):
        cache = KVCache(CONFIG, 1, "cpu", torch.float32)
        step, _ = compiled_step.compile_for(model, cache)
        with torch.no_grad():
            compiled = step.decode(tokens, cache)[:, -1]
            eager = model(tokens, KVCache(CONFIG, 1, "cpu", torch.float32))[0][:, -1]
        assert (compiled - eager).abs().max() <= 2**-7 * eager.abs().max()
    err = capsys.readouterr().err
    assert err.count("building the compiled step") == 1 and err.count("loaded from the cache") == 1
    assert len(list(folder.glob("*.pt2"))) == 1


@pytest.mark.parametrize("script, flags", [("generate.py", []), ("kv_cache.py", []),
                                           ("serve.py", ["--no-compile"])])
def test_no_compile_cache_applies_to_compile(script, flags):
    # serve.py's default loads a cached lone step, which --no-compile-cache turns off: only
    # beside --no-compile has it nothing to apply to
    result = run_script(script, *flags, "--no-compile-cache")
    assert result.returncode == 2
    assert "--no-compile-cache applies to --compile; add it, or drop --no-compile-cache" in result.stderr


def test_serve_py_build_only_builds_the_step_a_default_start_takes(tiny_ckpt, monkeypatch):
    # what serve.py's default start runs in the background where no lone step is cached: a
    # child `serve.py ARGS --compile --build-only --max-batch 1` (serving/background_build.py).
    # Its build must be the one a start with ARGS looks up (the same key: the same model,
    # prepared the same way), or the server would never take it. A real build (~20 s).
    import serve
    built = run_script("serve.py", "--ckpt", str(tiny_ckpt), "--device", "cpu", "--compile", "--build-only",
                       "--max-batch", "1")
    assert built.returncode == 0, built.stderr
    assert "the compiled single-stream step is in the cache" in built.stderr
    monkeypatch.setattr("sys.argv", ["serve.py", "--ckpt", str(tiny_ckpt), "--device", "cpu"])
    args = serve.parse_args()
    model, tokenizer, _ = serve.load_from_args(serve.CACHED_MODELS, args)
    engine = serve.make_engine(args, model, tokenizer)
    assert engine.runner.lone is not None  # loaded from the cache, not built
