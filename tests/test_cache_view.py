"""GET /v1/cache (serving/cache_view.py) and the page's files as the server hands them out,
without a browser (tests/test_web_page.py drives the page itself): what the view says of
each block while requests run and after, the page's files without the key and the data
not without it, and the headers that keep a prompt's text from running as script
(test_serving_server.py opens the URL serve.py prints)."""

import html.parser
import http.client
import json
import os
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("jinja2")
pytest.importorskip("prometheus_client")

from base_model import GPTConfig  # noqa: E402
from conftest import ROOT, byte_tokenizer, tiny_model  # noqa: E402
from serving import cache_view as view_module  # noqa: E402
from serving.cache_view import CACHED, FREE, HELD, SHARED, cache_view, cells, pool_formula  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.requests import SamplingParams  # noqa: E402
from serving.server import PAGE_FILES, BackgroundServer  # noqa: E402

CONFIG = GPTConfig(context_len=64, vocab_size=260, n_layer=2, n_head=4, n_embd=32)
TOKENIZER = byte_tokenizer()
KEY = "page-key"
TPB = 8  # tokens per block


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG, seed=3)


def view_of(engine, label=lambda request: None):
    return cache_view(engine, label, pool_formula(engine.model, engine.pool), {"name": "tiny"})


def test_the_view_says_which_blocks_are_held_shared_cached_and_free(model):
    engine = Engine(model, TOKENIZER, num_blocks=16, tokens_per_block=TPB, attention="gather")
    prompt = list(range(20))  # 2 full blocks and 4 tokens of a third
    params = SamplingParams(max_tokens=2, temperature=0)
    first = engine.add_request(prompt, params)
    second = engine.add_request(prompt, params)
    engine.step()  # one prefill admits both: the second finds the first's 2 full blocks
    view = view_of(engine, label=lambda r: ("cmpl-test", 0 if r is first else 1))
    assert view["counts"] == {"free": 12, "cached": 0, "held": 2, "shared": 2}
    a, b = view["requests"]
    assert (a["id"], a["choice"], a["state"], a["tokens"]) == ("cmpl-test", 0, "running", 21)
    assert a["blocks"][:2] == b["blocks"][:2] and a["blocks"][2] != b["blocks"][2]
    assert a["cached_prompt_tokens"] == 0 and b["cached_prompt_tokens"] == 16
    letters = {block: view["cells"][block - 1] for block in range(1, 17)}  # cell i is block i + 1
    assert [letters[x] for x in a["blocks"]] == ["s", "s", "h"] and letters[b["blocks"][2]] == "h"
    engine.run_until_done()
    # the full blocks stay in the prefix index, free; the partial ones are plain free
    view = view_of(engine)
    assert view["counts"] == {"free": 14, "cached": 2, "held": 0, "shared": 0}
    assert view["requests"] == [] and view["engine"]["running"] == 0
    assert [view["cells"][x - 1] for x in a["blocks"][:2]] == ["c", "c"]
    # the same prompt again is served from those two blocks
    engine.add_request(prompt, params)
    engine.step()
    assert view_of(engine)["requests"][0]["cached_prompt_tokens"] == 16


def test_a_large_pool_is_drawn_with_the_busiest_block_of_each_cell(monkeypatch):
    monkeypatch.setattr(view_module, "MAX_CELLS", 4)
    states = bytearray([FREE, FREE, HELD, FREE, CACHED, SHARED, FREE, FREE, FREE, FREE])
    # the null block, then 9 blocks: 3 cells of 3
    assert cells(states) == ("hs.", 3)
    assert cells(states[:4]) == (".h.", 1)


def test_the_formula_is_the_pools_own_bytes(model):
    engine = Engine(model, TOKENIZER, num_blocks=16, tokens_per_block=TPB, attention="gather")
    f = pool_formula(engine.model, engine.pool)
    head_dim = CONFIG.n_embd // CONFIG.n_head
    assert f["bytes_per_token"] == 2 * CONFIG.n_layer * CONFIG.n_head * head_dim * 4
    assert f["bytes_per_block"] == TPB * f["bytes_per_token"]
    assert f["pool_bytes"] == (16 + 1) * f["bytes_per_block"] == engine.pool.kv.nbytes  # + the null block


def test_an_int8_pools_formula_counts_codes_and_scales(model):
    engine = Engine(model, TOKENIZER, num_blocks=16, tokens_per_block=TPB, attention="gather",
                    kv_dtype="int8")
    f = pool_formula(engine.model, engine.pool)
    head_dim = CONFIG.n_embd // CONFIG.n_head
    assert f["dtype"] == "int8" and f["bytes_per_head"] == head_dim + 2  # codes and a float16 scale
    assert f["bytes_per_token"] == 2 * CONFIG.n_layer * CONFIG.n_head * f["bytes_per_head"]
    assert f["pool_bytes"] == (16 + 1) * f["bytes_per_block"] == engine.pool.kv.nbytes


# ---------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def keyed(model):
    """(base url of a server that wants KEY, its engine)"""
    engine = Engine(model, TOKENIZER, tokens_per_block=TPB, attention="gather")
    engine.start()
    try:
        with BackgroundServer(engine, TOKENIZER, "tiny", api_key=KEY, context_policy="reprefill") as url:
            yield url.removesuffix("/v1"), engine
    finally:
        engine.stop()


def get(url, key=None, body=None):
    """(status, headers, body bytes) of a GET, or a POST of body."""
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode())
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class Markup(html.parser.HTMLParser):
    """Every tag of a page, with its attributes."""

    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_the_page_loads_without_the_key_and_runs_only_its_own_files(keyed):
    base, _ = keyed
    for path, (name, kind) in PAGE_FILES.items():
        status, headers, body = get(base + path)
        assert status == 200 and headers["Content-Type"].startswith(kind), path
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert "unsafe-inline" not in headers["Content-Security-Policy"]
    page = Markup()
    page.feed(get(base + "/")[2].decode())
    scripts = [attrs for tag, attrs in page.tags if tag == "script"]
    assert scripts and all(attrs.get("src", "").startswith("/web/") for attrs in scripts)
    assert not any(tag == "style" or "style" in attrs or any(a.startswith("on") for a in attrs)
                   for tag, attrs in page.tags)  # nothing inline for the policy to refuse
    # what the model writes reaches the page as text: no script parses a string as HTML
    for name in os.listdir(ROOT / "serving" / "web"):
        source = (ROOT / "serving" / "web" / name).read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in source, f"{name} uses {sink}"


def test_the_pages_data_wants_the_key(keyed):
    base, _ = keyed
    for path, body in (("/v1/cache", None), ("/tokenize", {"prompt": "Hi"}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1})):
        status, _, answer = get(base + path, body=body)
        assert status == 401 and json.loads(answer)["error"]["code"] == "invalid_api_key", path
        assert get(base + path, key="wrong", body=body)[0] == 401
        assert get(base + path, key=KEY, body=body)[0] == 200


def test_tokenize_returns_each_tokens_text_when_asked(keyed):
    base, _ = keyed
    answer = json.loads(get(base + "/tokenize", KEY, {"prompt": "a<b>", "return_token_strs": True})[2])
    assert answer["tokens"] == list(b"a<b>") and answer["token_strs"] == ["a", "<", "b", ">"]
    assert json.loads(get(base + "/tokenize", KEY, {"prompt": "a"})[2])["token_strs"] is None
    assert get(base + "/tokenize", KEY, {"prompt": "a", "return_token_strs": "yes"})[0] == 400


def test_a_running_reply_is_in_the_view_under_its_id_until_its_client_leaves(keyed):
    base, engine = keyed
    host, port = base.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "ROMEO: " * 4, "max_tokens": 10**5, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    first = json.loads(response.readline().removeprefix(b"data: "))  # runs until we leave
    view = json.loads(get(base + "/v1/cache", KEY)[2])
    mine = [r for r in view["requests"] if r["id"] == first["id"]]
    assert len(mine) == 1 and mine[0]["state"] in ("running", "waiting")
    assert view["counts"]["held"] + view["counts"]["shared"] >= 1
    connection.close()  # the client leaves: its blocks go back
    for _ in range(600):
        view = json.loads(get(base + "/v1/cache", KEY)[2])
        if view["counts"]["held"] == view["counts"]["shared"] == 0:
            break
        time.sleep(0.05)
    assert view["requests"] == [] and view["counts"]["held"] == view["counts"]["shared"] == 0

