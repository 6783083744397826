"""The web page (serving/web/, GET /) in a real browser: headless Chromium driven by selenium
(requirements-browser.txt, and Debian's chromium and chromium-driver: .ci/run installs them),
against servers started here on 127.0.0.1 with the bundled model. A person's steps, each
checked against the API: a greedy reply streams in as tokens and is the API's text; the
cache's grid fills while a reply streams, and the stop button frees it; a second tab
with the same prompt shares its blocks; three tabs on a small pool show a preemption; a
chat goes through the template; what the model writes stays text; without the API key
the page gets nothing.

    python -m pytest tests/test_web_page.py --screenshot docs/serving-page.png

also saves the picture of the page that docs/serving.md shows (test_screenshot)."""

import json
import math
import re
import shutil
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("selenium", reason="no selenium: pip install -r requirements-browser.txt")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no chromium or chromedriver: apt-get install chromium chromium-driver",
                allow_module_level=True)

import torch  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from base_model import GPTConfig  # noqa: E402
from conftest import ROOT, byte_tokenizer, tiny_model  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import BUNDLED, load_model  # noqa: E402
from serving.chat import template_from_file  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import BackgroundServer  # noqa: E402

KEY = "browser-key"
WAIT_S = 60  # for what the page should show soon; a loaded CI machine is slow, nothing is timed
FOREVER = 10**5  # max_tokens of a reply that runs until stopped (the server keeps going: reprefill)
# 4 full blocks of 16 tokens and more, in the bundled model's tokenizer: a prefix to share
SPEECH = ("ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and "
          "Juliet is the sun.\nArise, fair sun, and kill the envious moon,\nWho is already sick "
          "and pale with grief,\nThat thou her maid art far more fair than she.\n")


# ---------------------------------------------------------------------------- servers

@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = load_model(CACHED_MODELS, BUNDLED, report=lambda line: None)
    engine = Engine(model, tokenizer, num_blocks=256, attention="gather")
    engine.start()  # serve.py runs the engine on its main thread; here pytest has that
    try:
        yield engine, tokenizer
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def url(bundled):
    """The page of a server with the bundled model's chat template (docs/clients/)."""
    engine, tokenizer = bundled
    template = template_from_file(ROOT / "docs" / "clients" / "shakespeare_chat.jinja", tokenizer)
    with BackgroundServer(engine, tokenizer, "kvcache-gpt", chat_template=template,
                          context_policy="reprefill") as api:
        yield api.removesuffix("v1")


class PacedEngine(Engine):
    """An engine that rests STEP_REST_S before each step: the bundled model decodes ~400
    tokens a second, so a reply runs past its 256-token context (and its reprefill lets go
    of the prompt's blocks) within a second, sooner than a loaded machine opens a second
    tab; at ~20 steps a second that takes ~10 s."""
    STEP_REST_S = 0.05

    def step(self):
        time.sleep(self.STEP_REST_S)
        return super().step()


def page_of(engine, tokenizer):
    """The page of a server over its own engine (started here, stopped at the end)."""
    engine.start()
    try:
        with BackgroundServer(engine, tokenizer, "kvcache-gpt", context_policy="reprefill") as api:
            yield api.removesuffix("v1")
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def paced_url(bundled):
    """The page of a server whose replies are paced (PacedEngine)."""
    model, tokenizer = bundled[0].model, bundled[1]
    yield from page_of(PacedEngine(model, tokenizer, num_blocks=256, attention="gather"), tokenizer)


@pytest.fixture(scope="module")
def small_pool_url(bundled):
    """The page of a server whose pool holds one full context, 16 blocks: three replies to
    prompts of 5 blocks do not fit for long, and the newest is preempted."""
    model, tokenizer = bundled[0].model, bundled[1]
    yield from page_of(Engine(model, tokenizer, num_blocks=16, attention="gather"), tokenizer)


def model_that_writes(text, vocab_size):
    """A GPT whose greedy reply to any prompt is `text` again and again (its characters all
    different, each a byte token): a bigram table written into the weights. The blocks and
    positions add nothing (zero output projections, zero position table), so the logits
    depend on the last token alone: character i is embedded as direction i, the output row
    of character i + 1 points along it, and every other token is embedded as the last
    character, so that the reply starts with the first."""
    n = len(text)
    model = tiny_model(GPTConfig(context_len=64, vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=n))
    embed, head = torch.zeros(vocab_size, n), torch.zeros(vocab_size, n)
    embed[:, n - 1] = 1
    for i, char in enumerate(text):
        embed[ord(char)] = torch.nn.functional.one_hot(torch.tensor(i), n).float()
        head[ord(text[(i + 1) % n]), i] = 10.0
    with torch.no_grad():
        model.transformer.wte.weight = torch.nn.Parameter(embed)  # untied from the head
        model.lm_head.weight = torch.nn.Parameter(head)
        model.transformer.wpe.weight.zero_()
        for block in model.transformer.h:
            for layer in (block.attn.c_proj, block.mlp.c_proj):
                layer.weight.zero_()
                layer.bias.zero_()
    return model


@pytest.fixture(scope="module")
def script_url():
    """The page of a server whose model writes <script>."""
    tokenizer = byte_tokenizer()
    engine = Engine(model_that_writes("<script>", 260), tokenizer, attention="gather")
    engine.start()
    try:
        with BackgroundServer(engine, tokenizer, "writer") as api:
            yield api.removesuffix("v1")
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def keyed_url(bundled):
    engine, tokenizer = bundled
    with BackgroundServer(engine, tokenizer, "kvcache-gpt", api_key=KEY) as api:
        yield api.removesuffix("v1")


def post(url, path, body):
    request = urllib.request.Request(url + path.lstrip("/"), data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def health(url):
    with urllib.request.urlopen(url + "health", timeout=60) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------------- the browser

@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, to check
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what):
    WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda _: condition(), message=what)


def js(driver, expression, *args):
    return driver.execute_script(f"return {expression}", *args)


def open_page(driver, url):
    driver.get(url)
    wait_for(driver, lambda: driver.find_element(By.ID, "cache-counts").text, "the cache view")


def fill(driver, fields):
    """Type into the sampling controls: {field: value}."""
    for name, value in fields.items():
        box = driver.find_element(By.NAME, name)
        box.clear()
        box.send_keys(str(value))


def send(driver, prompt, typed=True, **fields):
    fill(driver, fields)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    if typed:
        box.send_keys(prompt)
    else:  # a long prompt: set at once, not typed key by key
        driver.execute_script("arguments[0].value = arguments[1]", box, prompt)
    driver.find_element(By.ID, "send").click()


def record_bodies(driver):
    """From now on, keep every JSON body the page sends (sent_bodies reads them)."""
    driver.execute_script("window.sentBodies = []; const send = window.fetch; "
                          "window.fetch = (url, options = {}) => { if (options.body) "
                          "window.sentBodies.push([String(url), JSON.parse(options.body)]); "
                          "return send(url, options); };")


def sent_bodies(driver, path):
    return [body for url, body in js(driver, "window.sentBodies") if url.endswith(path)]


def finished(driver):
    return driver.find_element(By.ID, "stat-finish").text


def wait_finished(driver):
    wait_for(driver, lambda: finished(driver), "the reply's end")


def texts(driver, selector):
    return js(driver, f"Array.from(document.querySelectorAll('{selector}'), e => e.textContent)")


def grid(driver):
    """How many cells of the cache's grid are in each state, and this tab's."""
    return js(driver, "Object.fromEntries(['free', 'cached', 'held', 'shared', 'mine'].map(s => "
                      "[s, document.querySelectorAll('#cache-grid .' + s).length]))")


def shown(text):
    return text.replace("\n", "\u21b5\n")  # how a token box shows a newline


def no_console_errors(driver):
    """Nothing went wrong in the page: no script error, no refusal by the security policy."""
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


# ---------------------------------------------------------------------------- the tests

def test_a_greedy_reply_streams_in_as_tokens_and_is_the_apis_text(browser, url):
    prompt = "JULIET:\nO Romeo"
    open_page(browser, url)
    record_bodies(browser)
    send(browser, prompt, temperature=0, max_tokens=24)
    wait_finished(browser)
    # the controls left alone (top_p, min_p, the penalties, seed, stop) send nothing
    assert sent_bodies(browser, "/v1/completions") == [{
        "prompt": prompt, "logprobs": 5, "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}]
    api = post(url, "v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 24, "logprobs": 5})
    choice = api["choices"][0]
    assert texts(browser, "#conversation .reply") == [choice["text"]]
    assert texts(browser, "#reply-tokens .token") == [shown(t) for t in choice["logprobs"]["tokens"]]
    # each box shaded by its token's probability (written to 3 decimals)
    shades = js(browser, "Array.from(document.querySelectorAll('#reply-tokens .token'), "
                         "e => Number(e.style.getPropertyValue('--p')))")
    for shade, logprob in zip(shades, choice["logprobs"]["token_logprobs"]):
        assert shade == pytest.approx(math.exp(logprob), abs=6e-4)
    # the prompt as the model read it
    tokens = post(url, "tokenize", {"prompt": prompt, "return_token_strs": True})
    assert texts(browser, "#prompt-tokens .token") == [shown(t) for t in tokens["token_strs"]]
    assert browser.find_element(By.ID, "stat-tokens").text == "24"
    assert browser.find_element(By.ID, "stat-cached").text.endswith(f" of {tokens['count']}")
    assert browser.find_element(By.ID, "stat-ttft").text.endswith(" ms")
    # hovering the first token shows it and its alternatives, likeliest first
    first = browser.find_element(By.CSS_SELECTOR, "#reply-tokens .token")
    ActionChains(browser).move_to_element(first).perform()
    wait_for(browser, lambda: browser.find_element(By.ID, "tooltip").is_displayed(), "the tooltip")
    rows = [r.split("\t") for r in js(browser, "Array.from(document.querySelectorAll('#tooltip tr'), "
                                               "r => Array.from(r.cells, c => c.textContent).join('\\t'))")]
    chosen = choice["logprobs"]["tokens"][0]
    alternatives = sorted(((v, t) for t, v in choice["logprobs"]["top_logprobs"][0].items() if t != chosen),
                          reverse=True)
    assert rows[0][0] == json.dumps(chosen) and rows[0][2] == "chosen"
    assert [r[0] for r in rows[1:]] == [json.dumps(t) for _, t in alternatives]
    # the prompt box now holds prompt + reply: sent again, it goes on from the cached prefix
    assert js(browser, "document.getElementById('prompt').value") == prompt + choice["text"]
    browser.find_element(By.ID, "send").click()
    wait_for(browser, lambda: browser.find_element(By.ID, "stat-cached").text, "the second reply's usage")
    assert int(browser.find_element(By.ID, "stat-cached").text.split(" of ")[0]) >= 16  # a block
    no_console_errors(browser)


def test_a_structured_output_and_min_p_typed_in_the_controls_reach_the_server(browser, url):
    open_page(browser, url)
    record_bodies(browser)
    choices = ["ROMEO", "JULIET", "NURSE"]
    send(browser, "Who speaks? ", temperature=1, min_p=0.05, max_tokens=8,
         structured_outputs=json.dumps({"choice": choices}))
    wait_finished(browser)
    body, = sent_bodies(browser, "/v1/completions")
    assert body["min_p"] == 0.05 and body["structured_outputs"] == {"choice": choices}
    # the server held the sampled text to the choice: a random model left to itself would not
    assert texts(browser, "#conversation .reply")[0] in choices
    no_console_errors(browser)


def test_the_grid_fills_while_a_reply_streams_and_the_stop_button_frees_it(browser, url):
    open_page(browser, url)
    assert grid(browser)["held"] == grid(browser)["shared"] == 0
    send(browser, "ROMEO:\n", max_tokens=FOREVER)
    wait_for(browser, lambda: grid(browser)["mine"] > 0 and grid(browser)["held"] > 0, "this tab's blocks")
    assert any(t.endswith("(this tab)") for t in texts(browser, "#cache-requests td:first-child"))
    stop = browser.find_element(By.ID, "stop")
    where = stop.location
    # the reply outgrows the conversation's box: the box follows its end, the button stays put
    wait_for(browser, lambda: js(browser, "document.getElementById('conversation').scrollTop") > 0,
             "a reply longer than its box")
    box = js(browser, "(b => [b.scrollHeight, b.scrollTop, b.clientHeight])(document.getElementById('conversation'))")
    assert box[0] - box[1] - box[2] < 30, box  # at the end, give or take the last token's line
    assert stop.location == where
    stop.click()
    wait_for(browser, lambda: grid(browser)["held"] == grid(browser)["shared"] == 0, "the blocks freed")
    assert finished(browser) == "stopped" and texts(browser, "#cache-requests tr") == []
    h = health(url)
    assert h["running"] == h["waiting"] == 0 and h["blocks_free"] == h["blocks_total"]
    no_console_errors(browser)


def test_a_second_tab_with_the_same_prompt_shares_its_blocks(browser, paced_url):
    url = paced_url  # the first reply still holds its prompt's blocks when the second comes
    first_tab = browser.current_window_handle
    open_page(browser, url)
    send(browser, SPEECH, typed=False, max_tokens=FOREVER)
    wait_for(browser, lambda: grid(browser)["mine"] > 0, "the first tab's blocks")
    browser.switch_to.new_window("tab")
    try:
        open_page(browser, url)
        send(browser, SPEECH, typed=False, max_tokens=FOREVER)
        full_blocks = len(post(url, "tokenize", {"prompt": SPEECH})["tokens"]) // 16
        assert full_blocks >= 4
        # the prompt's full blocks are the first tab's, now held by both
        wait_for(browser, lambda: grid(browser)["shared"] >= full_blocks, "shared blocks")
        assert len(texts(browser, "#cache-requests tr")) == 2
        browser.switch_to.window(first_tab)
        wait_for(browser, lambda: grid(browser)["shared"] >= full_blocks, "shared, seen from the first tab")
        browser.find_element(By.ID, "stop").click()
        browser.switch_to.window(browser.window_handles[1])
        browser.find_element(By.ID, "stop").click()
        wait_for(browser, lambda: grid(browser)["held"] == grid(browser)["shared"] == 0, "every block freed")
        # both gone, the prompt's blocks stay cached for the next one that starts so
        assert grid(browser)["cached"] >= full_blocks
        no_console_errors(browser)
    finally:
        browser.close()
        browser.switch_to.window(first_tab)


def test_three_tabs_on_a_small_pool_show_a_preemption(browser, small_pool_url):
    first_tab = browser.current_window_handle

    def preemptions():  # as the page says it: "..., 1 preemptions; ..."
        return int(re.search(r"(\d+) preemptions", browser.find_element(By.ID, "cache-engine").text)[1])
    try:
        for i in range(3):
            if i:
                browser.switch_to.new_window("tab")
            open_page(browser, small_pool_url)
            send(browser, f"{i}. {SPEECH}", typed=False, max_tokens=FOREVER)  # no prefix shared
        wait_for(browser, lambda: preemptions() >= 1, "a preemption")
    finally:
        for handle in browser.window_handles[::-1]:
            browser.switch_to.window(handle)
            browser.find_element(By.ID, "stop").click()
            if handle != first_tab:
                browser.close()
        browser.switch_to.window(first_tab)
    wait_for(browser, lambda: grid(browser)["held"] == grid(browser)["shared"] == 0, "every block freed")
    no_console_errors(browser)


def test_chat_renders_the_template_and_replies_as_the_api_does(browser, url):
    open_page(browser, url)
    assert "shakespeare_chat.jinja" in browser.find_element(By.ID, "template-note").text
    browser.find_element(By.CSS_SELECTOR, "input[value=chat]").click()
    browser.find_element(By.ID, "system").send_keys("A street in Verona.")
    record_bodies(browser)
    send(browser, "Good morrow, cousin.", temperature=0, max_tokens=40, stop=r"\n\n")  # the box's escape
    wait_finished(browser)
    messages = [{"role": "system", "content": "A street in Verona."},
                {"role": "user", "content": "Good morrow, cousin."}]
    assert sent_bodies(browser, "/v1/chat/completions")[0]["stop"] == ["\n\n"]
    api = post(url, "v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 40,
                                            "stop": ["\n\n"]})
    assert texts(browser, "#conversation .message .text") == [
        "A street in Verona.", "Good morrow, cousin.", api["choices"][0]["message"]["content"]]
    tokens = post(url, "tokenize", {"messages": messages, "return_token_strs": True})
    assert texts(browser, "#prompt-tokens .token") == [shown(t) for t in tokens["token_strs"]]
    assert "JULIET:" in "".join(tokens["token_strs"])  # the template's speaker names
    no_console_errors(browser)


def test_what_the_model_writes_is_shown_as_text(browser, script_url):
    open_page(browser, script_url)
    prompt = '<img src=x onerror="window.injected = 1">'
    send(browser, prompt, temperature=0, max_tokens=16)
    wait_finished(browser)
    assert texts(browser, "#conversation .reply") == ["<script><script>"]
    assert texts(browser, "#reply-tokens .token") == list("<script><script>")
    assert texts(browser, "#prompt-tokens .token") == list(prompt)
    assert js(browser, "document.querySelectorAll('main script, main img').length") == 0
    assert js(browser, "window.injected === undefined")
    no_console_errors(browser)


def test_the_page_asks_for_the_api_key_and_gets_no_data_without_it(browser, keyed_url):
    browser.get(keyed_url)  # the page itself loads without the key
    key_form = browser.find_element(By.ID, "key-form")
    wait_for(browser, key_form.is_displayed, "the key form")
    assert "API key" in browser.find_element(By.ID, "key-note").text
    assert js(browser, "document.querySelectorAll('#cache-grid .cell').length") == 0
    browser.find_element(By.ID, "api-key").send_keys("wrong")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(browser, key_form.is_displayed, "the key form again")
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(browser, lambda: browser.find_element(By.ID, "model-name").text, "the model, with the key")
    assert not key_form.is_displayed() and grid(browser)["free"] > 0
    # this server has no chat template: chat is off, and the page says why
    assert not browser.find_element(By.CSS_SELECTOR, "input[value=chat]").is_enabled()
    assert "no chat template" in browser.find_element(By.ID, "template-note").text
    send(browser, "ROMEO:", max_tokens=4)
    wait_finished(browser)
    assert texts(browser, "#conversation .reply")[0]
    # the only errors: the 401s before the key was given
    assert all("401" in e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE")


def test_screenshot(browser, url, request):
    """The picture in docs/serving.md: a chat streaming while a second tab, which started
    the same conversation, streams too (their prefix shared), the reply's first token hovered."""
    path = request.config.getoption("--screenshot")
    if not path:
        pytest.skip("only with --screenshot PNG")
    first_tab = browser.current_window_handle
    start = ("The scene: Verona, a public place. Two households, both alike in dignity, "
             "keep an ancient grudge; their children meet, and love.")
    open_page(browser, url)
    browser.switch_to.new_window("tab")
    try:
        open_page(browser, url)
        browser.find_element(By.CSS_SELECTOR, "input[value=chat]").click()
        browser.find_element(By.ID, "system").send_keys(start)
        send(browser, "Speak, Romeo: what says your heart?", typed=False, max_tokens=FOREVER)
        browser.switch_to.window(first_tab)
        browser.find_element(By.CSS_SELECTOR, "input[value=chat]").click()
        browser.find_element(By.ID, "system").send_keys(start)
        send(browser, "Speak, Romeo: what says your heart?", typed=False, max_tokens=FOREVER, seed=7)
        wait_for(browser, lambda: len(texts(browser, "#reply-tokens .token")) >= 40, "a reply")
        first = browser.find_element(By.CSS_SELECTOR, "#reply-tokens .token")
        ActionChains(browser).move_to_element(first).perform()  # its alternatives in the picture
        browser.save_screenshot(path)
        browser.find_element(By.ID, "stop").click()
    finally:
        browser.switch_to.window(browser.window_handles[1])
        browser.find_element(By.ID, "stop").click()
        browser.close()
        browser.switch_to.window(first_tab)
