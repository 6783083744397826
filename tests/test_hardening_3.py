"""Hostile inputs that were silently wrong or slow, each now one clear line or answer:

  - SIGTERM (what docker stop, systemd and Kubernetes send) stops serve.py as Ctrl-C does:
    every stream ends with an error event and [DONE], then the process ends by SIGTERM; a second
    signal ends it at once;
  - "model": null is the model served (as vLLM), on every endpoint;
  - stop strings longer in all than a context can hold are a 400 naming 'stop', and their
    matching table is built once per request, not once per sample;
  - Hugging Face directories whose shards, config or tokenizer cannot mean what they say
    are refused in one line naming the file or the field."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import NO_BACKGROUND_BUILD, ROOT, byte_tokenizer

TOKENIZER = byte_tokenizer()


# ---------------------------------------------------------------------------- SIGTERM

def start_serve(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **NO_BACKGROUND_BUILD}
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # 'serving NAME on http://127.0.0.1:PORT/v1 (...)'
        if line.startswith("serving "):
            return process, line.split()[3]
    process.kill()
    raise AssertionError("serve.py ended without serving")


def test_sigterm_ends_every_stream_with_an_error_then_the_process_by_sigterm(tiny_ckpt):
    pytest.importorskip("aiohttp")
    process, url = start_serve("--ckpt", str(tiny_ckpt), "--port", "0", "--device", "cpu",
                               "--attention", "gather", "--context-policy", "reprefill")
    try:
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Hi", "max_tokens": 10**6, "stream": True, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rest = response.read()  # to the stream's last chunk: a cut stream raises IncompleteRead
        events = [line.removeprefix(b"data: ") for line in rest.splitlines() if line]
        assert events[-1] == b"[DONE]"  # the final chunk, after the error
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        # death by SIGTERM, as the shell reports it: status 143 (128 + 15)
        assert process.wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - sent < 10
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()


FAKE_ENGINE = """
import sys, time
import serve

class DeafEngine:  # a step that never ends: only a second signal can end the process
    def run(self):
        print("running", flush=True)
        while True:
            time.sleep(0.01)

    def stop(self):
        pass

serve.run_until_stopped(DeafEngine())
"""


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_ends_the_process_at_once(first):
    process = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "running\n"
        process.send_signal(first)
        time.sleep(0.2)  # the first has been handled: the engine was asked to stop
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == -signal.SIGTERM
    finally:
        process.kill()


# ---------------------------------------------------------------------------- model: null

def test_model_null_is_the_model_served_on_every_endpoint():
    from serving.admission import Limits
    from serving.request_parsing import (BadRequest, parse_chat, parse_completion, parse_detokenize,
                                         parse_tokenize)
    parsed = parse_completion({"model": None, "prompt": "Hi"}, TOKENIZER, 64, "tiny", Limits())
    assert parsed.prompts == [list(b"Hi")]
    assert parse_tokenize({"model": None, "prompt": "Hi"}, TOKENIZER, 64, "tiny", None) == (list(b"Hi"), False)
    assert parse_detokenize({"model": None, "tokens": [72]}, TOKENIZER, "tiny") == [72]
    with pytest.raises(BadRequest) as e:  # past the model check: on to the (missing) template
        parse_chat({"model": None, "messages": [{"role": "user", "content": "Hi"}]}, TOKENIZER,
                   64, "tiny", None, Limits())
    assert e.value.code == "chat_template_missing"
    with pytest.raises(BadRequest, match='"other" does not exist') as e:
        parse_completion({"model": "other", "prompt": "Hi"}, TOKENIZER, 64, "tiny", Limits())
    assert e.value.param == "model" and e.value.code == "model_not_found"


# ---------------------------------------------------------------------------- stop strings

def test_stop_strings_past_what_a_context_holds_are_a_400_naming_stop():
    from plumbing.user_text import longest_token_bytes
    from serving.admission import Limits
    from serving.request_parsing import BadRequest, parse_completion
    context = 64
    bound = context * longest_token_bytes(TOKENIZER)
    at_bound = ["x" * (bound // 4)] * 4
    parsed = parse_completion({"prompt": "Hi", "stop": at_bound}, TOKENIZER, context, "tiny", Limits())
    assert parsed.samples[0].stop == tuple(at_bound)
    for stop in (["x" * (bound + 1)], [*at_bound[:3], "x" * (bound // 4 + 1)], ["x" * 250_000] * 4):
        with pytest.raises(BadRequest, match="'stop' strings have .* characters in all") as e:
            parse_completion({"prompt": "Hi", "stop": stop, "n": 64}, TOKENIZER, context, "tiny", Limits())
        assert e.value.param == "stop" and e.value.status == 400


def test_the_samples_of_a_request_share_one_matching_table_per_stop_string():
    from plumbing.text_stream import SampleText
    stops = ["ab" * 5_000, "cd" * 5_000]
    a, b = SampleText(TOKENIZER, stops), SampleText(TOKENIZER, stops)
    assert all(x.border is y.border for x, y in zip(a.stops, b.stops))
    for token in b"abab":
        a.add(token)
    assert a.ready() == 0 and b.ready() == 0  # the matches are each sample's own


# ---------------------------------------------------------------------------- loading

def write_shards(path, shards, weight_map):
    """shards: {file name: {tensor name: tensor}}, and an index naming weight_map."""
    from safetensors.torch import save_file
    for name, tensors in shards.items():
        save_file(tensors, str(path / name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_tensor_in_two_shards_or_in_another_than_the_index_names_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    import torch
    from plumbing.hf import read_weights
    from plumbing.script import CheckpointError
    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    cases = {  # name: (shards, weight_map, what the one line says); the index names both shards
        "two copies": ({"one.safetensors": {"x": a, "y": c}, "two.safetensors": {"x": b, "z": c}},
                       {"x": "one.safetensors", "y": "one.safetensors", "z": "two.safetensors"},
                       "'x' is in two shards, one.safetensors and two.safetensors"),
        "moved": ({"one.safetensors": {"y": a}, "two.safetensors": {"x": b, "z": c}},
                  {"x": "one.safetensors", "y": "one.safetensors", "z": "two.safetensors"},
                  "names 'one.safetensors' for 'x', but two.safetensors holds it"),
    }
    for name, (shards, weight_map, message) in cases.items():
        path = tmp_path / name.replace(" ", "-")
        path.mkdir()
        write_shards(path, shards, weight_map)
        with pytest.raises(CheckpointError, match=message) as e:
            read_weights(path)
        assert "\n" not in str(e.value)
    path = tmp_path / "right"
    path.mkdir()
    write_shards(path, {"one.safetensors": {"y": a}, "two.safetensors": {"x": b}},
                 {"x": "two.safetensors", "y": "one.safetensors"})
    state_dict = read_weights(path)
    assert state_dict.keys() == {"x", "y"} and torch.equal(state_dict["x"], b)


MISTRAL = {"model_type": "mistral", "max_position_embeddings": 4096, "vocab_size": 300,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
           "hidden_size": 64, "intermediate_size": 96, "sliding_window": 256}


@pytest.mark.parametrize("changes,message", [
    ({"sliding_window": -5}, "sliding_window must be a positive integer or null"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer or null"),
    ({"sliding_window": 256.0}, "sliding_window must be a positive integer or null"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": -1},
     "max_window_layers must be an integer >= 0 or null"),
    ({"rope_theta": 0}, "rope_theta must be a finite number above 1"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a number in \\(0, 1\\)"),
    ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads"),
])
def test_config_values_that_cannot_mean_anything_are_refused_naming_the_field(tmp_path, changes, message):
    from plumbing.hf_llama import llama_config
    from plumbing.script import CheckpointError
    with pytest.raises(CheckpointError, match=message):
        llama_config({**MISTRAL, **changes}, tmp_path / "config.json")


def test_the_sliding_window_cuts_the_context_and_null_means_none(tmp_path):
    from plumbing.hf_llama import llama_config
    file = tmp_path / "config.json"
    assert llama_config(MISTRAL, file).context_len == 256
    assert llama_config({**MISTRAL, "sliding_window": None}, file).context_len == 4096
    # an unused window is not read: Qwen2's configs carry one with use_sliding_window false
    assert llama_config({**MISTRAL, "model_type": "qwen2", "sliding_window": -5}, file).context_len == 4096


def test_a_tokenizer_json_with_an_empty_vocabulary_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    from hf_llama_dirs import sentencepiece_tokenizer
    from plumbing.hf_tokenizer import read_tokenizer
    from plumbing.script import CheckpointError
    sentencepiece_tokenizer().save_pretrained(tmp_path)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer["model"].update(vocab={}, merges=[])
    for added in (tokenizer["added_tokens"], []):  # the special tokens alone, or nothing at all
        (tmp_path / "tokenizer.json").write_text(json.dumps({**tokenizer, "added_tokens": added}))
        with pytest.raises(CheckpointError, match="the vocabulary \\(model.vocab\\) is empty") as e:
            read_tokenizer(tmp_path, (None, []), {})
        assert "\n" not in str(e.value)


def test_a_broken_directory_is_one_line_and_exit_2_from_the_command(tmp_path):
    from conftest import run_script
    from hf_llama_dirs import make_hf_llama_dir
    make_hf_llama_dir(tmp_path, "mistral-mqa-window")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": -5}))
    result = run_script("generate.py", "--hf", tmp_path, "--device", "cpu", "--max-new-tokens", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "sliding_window must be a positive integer or null" in result.stderr


# ---------------------------------------------------------------------------- --score

def test_windows_scored_in_batches_give_the_loss_of_windows_one_at_a_time(monkeypatch):
    import torch
    from conftest import TINY_CONFIGS, tiny_model
    from plumbing import scoring
    model, text = tiny_model(TINY_CONFIGS[0], seed=2), "To be, or not to be: that is the question. " * 20
    seen = []
    batched = scoring.score(model, TOKENIZER, text, torch.device("cpu"),
                            progress=lambda done, total: seen.append((done, total)))
    monkeypatch.setattr(scoring, "LOGITS_BUDGET", 1)  # one window per forward pass
    alone = scoring.score(model, TOKENIZER, text, torch.device("cpu"))
    # float32 sums in another order (a batch's matrix products): noise at 1e-6
    assert batched["nats_per_token"] == pytest.approx(alone["nats_per_token"], rel=1e-5)
    windows = len(scoring.score_windows(len(text), TINY_CONFIGS[0].context_len))
    assert windows > 16 and seen == [(min(d, windows), windows) for d in range(16, windows + 16, 16)]


def test_ctrl_c_stops_a_long_score_in_one_line(tmp_path, tiny_ckpt, monkeypatch):
    # whitespace, the case that took more than 5 minutes: a token per character here. Ctrl-C
    # comes as KeyboardInterrupt between two batches (here raised by the progress callback
    # after the second, in-process: a process of its own costs seconds to start)
    from conftest import run_script
    from plumbing import scoring
    path = tmp_path / "spaces.txt"
    path.write_text(" \n\t" * 10_000)
    report = scoring.Progress.__call__

    def interrupted(progress, done, total):
        report(progress, done, total)
        if done >= 32:
            raise KeyboardInterrupt
    monkeypatch.setattr(scoring.Progress, "__call__", interrupted)
    result = run_script("generate.py", "--ckpt", tiny_ckpt, "--device", "cpu", "--score", path)
    assert result.returncode == 130 and result.stdout == ""  # no result for a text scored in part
    windows = len(scoring.score_windows(30_000, 64))
    assert result.stderr.splitlines()[-1] == (f"--score {path}: stopped by Ctrl-C "
                                              f"(32 of {windows:,} windows scored)")
