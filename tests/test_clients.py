"""Third-party clients against serve.py, as docs/clients.md runs them: lm-evaluation-harness
scores the bundled model through the server as its own `hf` backend scores the export, and
guidellm's benchmark gets every request answered. Each client lives in a venv of its own
(requirements-clients.txt; .ci/run makes them) named by its executable, $LM_EVAL and
$GUIDELLM; without one its test skips in one line. Both read the exported directory's
tokenizer and nothing from the network (HF_HUB_OFFLINE)."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from benchmarks.server_peers import free_port, wait_ready
from conftest import NO_BACKGROUND_BUILD, ROOT
from export_hf import export

LM_EVAL, GUIDELLM = os.environ.get("LM_EVAL"), os.environ.get("GUIDELLM")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TASKS = ROOT / "docs" / "clients" / "lm_eval"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("clients") / "hf"
    export(None, out, report=lambda line: None)  # the bundled model
    return out


@pytest.fixture(scope="module")
def server():
    """serve.py on the bundled model with docs/clients' chat template: (its URL, its log)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--no-compile", "--port", str(port),
                                "--chat-template", str(ROOT / "docs" / "clients" / "shakespeare_chat.jinja")],
                               cwd=ROOT, env={**os.environ, **NO_BACKGROUND_BUILD}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/v1", process, "serve.py")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def blocks_in_use(url):
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        health = json.load(response)
    return health["blocks_total"] - health["blocks_free"], health["preemptions"]


def lm_eval(model, model_args, out):
    """lm_eval's results ({task: {metric: value}}) for the two local tasks, 4 documents each."""
    proc = subprocess.run([LM_EVAL, "--model", model, "--model_args", model_args, "--tasks",
                           "heldout_next_speech,heldout_text", "--include_path", str(TASKS), "--limit", "4",
                           "--output_path", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"]


@pytest.mark.skipif(not LM_EVAL, reason="set LM_EVAL to lm_eval's executable (a venv with "
                    "requirements-clients.txt's lm_eval[api,hf]) to score through the server")
def test_lm_eval_through_the_server_scores_as_its_own_hf_backend(hf_dir, server, tmp_path):
    # 254 and 256: the same windows (docs/clients.md says why they differ)
    theirs = lm_eval("hf", f"pretrained={hf_dir},max_length=254,dtype=float32", tmp_path / "hf")
    ours = lm_eval("local-completions", f"model=kvcache-gpt,base_url={server}/v1/completions,"
                   f"tokenizer={hf_dir},max_length=256,num_concurrent=4", tmp_path / "ours")
    # a choice is an argmax of summed log-probabilities: the same choices, the same accuracy
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["heldout_next_speech"][metric] == theirs["heldout_next_speech"][metric]
    # the same fp32 model in batches of other shapes: sums in another order, 1e-6 relative
    for metric in ("bits_per_byte,none", "byte_perplexity,none", "word_perplexity,none"):
        assert ours["heldout_text"][metric] == pytest.approx(theirs["heldout_text"][metric], rel=1e-6)
    assert blocks_in_use(server) == (0, 0)


@pytest.mark.skipif(not GUIDELLM, reason="set GUIDELLM to guidellm's executable (a venv with "
                    "requirements-clients.txt's guidellm) to benchmark the server with it")
def test_guidellm_gets_every_chat_request_answered(hf_dir, server, tmp_path):
    report = tmp_path / "guidellm.json"
    proc = subprocess.run([GUIDELLM, "run", "--backend", f"kind=openai_http,target={server}",
                           "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
                           "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                           "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
                           "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    assert blocks_in_use(server) == (0, 0)
