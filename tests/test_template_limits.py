"""Chat templates are programs from a file: every render runs on a budget (serving/
template_limits.py), and a template that passes a bound is one line, never a hang, a
traceback or a worker held:

  - at load (serve.py's end-of-turn probe renders the template once): exit 2 and one line;
  - per request: HTTP 400 with OpenAI's error object, the worker free again, other clients
    answered meanwhile, every block free afterwards;
  - the template file read only when it is a regular file (not /dev/zero, not a FIFO), and
    tokenizer_config.json's list of named templates checked entry by entry;
  - a property test: random small templates over random messages give a string or a
    TemplateError, nothing else.

The bounds are counts (steps, characters), not times, so what each case hits does not
depend on how busy the machine is; RENDER_SECONDS is only the backstop for slow steps."""

import json
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("jinja2")

from conftest import byte_tokenizer, run_script  # noqa: E402
from serving import template_limits  # noqa: E402
from serving.chat import (TEMPLATE_MAX_BYTES, ChatTemplate, TemplateError, TemplateTooCostly,  # noqa: E402
                          read_template, template_from_hf_dir)

TOKENIZER = byte_tokenizer()
HI = [{"role": "user", "content": "Hi"}]
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
# loops only when a message says so: the end-of-turn probe passes, a request does not
ON_EVIL = ("{% for m in messages %}{% if m.content == 'evil' %}{% for i in range(100000) %}"
           "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}")
# Llama 3's instruct template (as tests/test_llama_chat.py's, which needs transformers)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
STEPS, CHARS = "more than 200,000 steps", "more than 33,554,432 characters"

# (template, what the one line says): each past a different bound
COSTLY = [
    (NESTED_RANGES, STEPS),
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}"
     "{% endfor %}{% endfor %}x", STEPS),  # no range, no call: the loops' items are counted
    ("{{ 'x' * 1500000000 }}", CHARS),
    ("{{ ['x'] * 1500000000 }}", "a list of more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", CHARS),  # doubled by ~, which Jinja compiles to a join
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s|length }}", CHARS),
    ("{{ 'x'|center(1500000000) }}", "'center' was given 1,500,000,000"),
    ("{{ '%01000000000d' % 1 }}", "a format width of 1,000,000,000"),
    ("{{ '{:>1000000000}'.format(1) }}", "a format width of 1,000,000,000"),
    ("{{ 9 ** (9 ** 9) }}", "bits"),
    ("{% set s = 'x' * 1000000 %}{{ s|replace('', s) }}", CHARS),  # estimated before it runs
    ("{% set s = 'x' * 1000000 %}{{ range(1000)|map('string')|join(s) }}", CHARS),
    ("{% macro f() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}"
     "{{ f()|length }}", CHARS),  # a macro's output, collected before it is returned
    ("{% for i in range(100000) %}" + "y" * 100 + "{% endfor %}", "writes more than 2,097,152"),
    ("{{ ('x' * 2000000)|sort|length }}", "'sort' given a value of more than"),
]


@pytest.mark.parametrize("source, message", COSTLY, ids=range(len(COSTLY)))
def test_a_costly_template_is_stopped_with_the_bound_it_passed(source, message):
    # at load (the end-of-turn probe), or on a longer conversation (100 messages)
    with pytest.raises(TemplateTooCostly, match=message):
        ChatTemplate(source, TOKENIZER, origin="chat.jinja").render(HI * 100)


def test_errors_of_a_template_are_template_errors_not_tracebacks():
    # endless recursion meets Python's limit, or on a slow or busy machine the time limit first
    endless = ("RecursionError", "it takes longer than")
    cases = {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}": endless,
             "{% for m in messages recursive %}{{ loop([m, m]) }}{% endfor %}": endless,
             "{{ lipsum(1000000) }}": "'lipsum' is undefined",  # removed: lorem ipsum on demand
             "{{ raise_exception('no\\n' * 1000000) }}": "no",  # the first 500 characters
             "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}": "not a Jinja template",
             "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000: "not a Jinja template",
             "{% for i in [1] %}" * 50 + "x" + "{% endfor %}" * 50: "not a Jinja template"}
    for source, message in cases.items():
        try:
            ChatTemplate(source, TOKENIZER).render(HI)
        except TemplateError as e:
            messages = message if isinstance(message, tuple) else (message,)
            assert any(m in str(e) for m in messages) and "\n" not in str(e)
        else:
            raise AssertionError(f"{source[:40]} rendered")


def test_a_template_that_loops_on_some_content_is_refused_for_that_request_only():
    template = ChatTemplate(ON_EVIL, TOKENIZER)  # the probe does not loop
    with pytest.raises(TemplateTooCostly, match=STEPS):
        template.render([{"role": "user", "content": "evil"}])
    assert template.render([{"role": "user", "content": "fine"}]) == "fine"


def test_an_empty_render_says_so():
    with pytest.raises(TemplateError, match="rendered these messages as an empty prompt"):
        ChatTemplate("{% if false %}x{% endif %}", TOKENIZER).render(HI)


def test_a_real_template_renders_as_jinja_renders_it_and_uses_little_of_the_budget():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 20}
                for i in range(1000)]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(LLAMA3)
    template = ChatTemplate(LLAMA3, TOKENIZER, bos_token="<s>")
    assert template.render(messages) == plain.render(messages=messages, add_generation_prompt=True,
                                                     bos_token="<s>", eos_token=template.eos_token)
    with template_limits.render_budget():  # 1,000 messages: ~1% of each bound
        "".join(template.template.generate(messages=messages, bos_token="<s>"))
        left = template_limits.budget()
    assert left.steps > 0.98 * template_limits.RENDER_STEPS
    assert left.chars > 0.9 * template_limits.RENDER_MADE_CHARS


def test_render_takes_extra_variables():  # tools, chat_template_kwargs: the caller's to pass
    template = ChatTemplate("{{ messages[0].content }} {{ tools|length }}", TOKENIZER)
    assert template.render(HI, tools=[1, 2]) == "Hi 2"


# ---------------------------------------------------------------------------- reading the file

def test_only_a_regular_file_is_read_as_a_template(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo, tmp_path):
        with pytest.raises(TemplateError, match="not a regular file|cannot read it"):
            read_template(path)
    big = tmp_path / "big.jinja"
    big.write_bytes(b"x" * (TEMPLATE_MAX_BYTES + 1))
    with pytest.raises(TemplateError, match="larger than"):
        read_template(big)
    (tmp_path / "ok.jinja").write_text("{{ messages[0].content }}")
    assert read_template(tmp_path / "ok.jinja") == "{{ messages[0].content }}"


@pytest.mark.parametrize("entries", [
    [{"name": ["default"], "template": "x"}],  # a list for a name: a TypeError before
    [{"name": "default", "template": 5}],
    ["default"],
])
def test_a_malformed_list_of_named_templates_is_one_line(tmp_path, entries):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entries}))
    with pytest.raises(TemplateError, match=r"chat_template\[0\] must be"):
        template_from_hf_dir(tmp_path, TOKENIZER)


def test_a_chat_template_string_past_the_file_limit_is_refused_before_it_compiles(tmp_path):
    source = "{{ messages[0].content }}" * (TEMPLATE_MAX_BYTES // 20)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(TemplateError, match="its chat_template is larger than 262,144 bytes"):
        template_from_hf_dir(tmp_path, TOKENIZER)


def test_a_costly_template_in_tokenizer_config_is_stopped_at_load(tmp_path):
    # serve.py --hf DIR hung here, at the end-of-turn probe; serve.py makes this one line
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": NESTED_RANGES}))
    with pytest.raises(TemplateTooCostly, match=STEPS):
        template_from_hf_dir(tmp_path, TOKENIZER)


def test_the_list_form_uses_the_template_named_default(tmp_path):
    entries = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entries}))
    assert template_from_hf_dir(tmp_path, TOKENIZER).render(HI) == "D"


@pytest.mark.parametrize("make, message", [
    (lambda d: "/dev/zero", "not a regular file"),
    (lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1], "not a regular file"),
    (lambda d: ((d / "loop.jinja").write_text(NESTED_RANGES), d / "loop.jinja")[1], STEPS),
])
def test_serve_refuses_such_a_template_at_start_in_one_line(tmp_path, tiny_ckpt, make, message):
    pytest.importorskip("aiohttp")
    result = run_script("serve.py", "--ckpt", str(tiny_ckpt), "--device", "cpu", "--port", "0",
                        "--chat-template", str(make(tmp_path)))
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("serve.py: error: --chat-template: ") and message in error
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- over HTTP

def test_a_costly_request_is_a_400_and_others_are_answered_meanwhile():
    pytest.importorskip("aiohttp")
    from test_fuzz_requests import chat_server, post
    with chat_server(ChatTemplate(ON_EVIL, TOKENIZER)) as (url, engine):
        answers = []

        def evil():
            answers.append(post(url, "/v1/chat/completions", {"messages": [
                {"role": "user", "content": "evil"}], "max_tokens": 1}))
        # more costly requests at once than the server has worker threads (6 on 2 cores)
        threads = [threading.Thread(target=evil) for _ in range(8)]
        for t in threads:
            t.start()
        status, body = post(url, "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "fine"}], "max_tokens": 2})
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        for t in threads:
            t.join(60)
        assert len(answers) == 8
        for status, body in answers:
            assert status == 400 and body["error"]["param"] == "messages"
            # its steps, or (eight renders sharing a busy machine's cores) the backstop's seconds
            assert "the template was stopped: it takes" in body["error"]["message"]
        status, health = post(url, "/health", None)
        assert health["blocks_free"] == health["blocks_total"] and health["running"] == 0


def test_an_empty_render_is_a_400_that_says_so():
    pytest.importorskip("aiohttp")
    from test_fuzz_requests import chat_server, post
    with chat_server(ChatTemplate("{% if false %}x{% endif %}", TOKENIZER)) as (url, engine):
        status, body = post(url, "/v1/chat/completions", {"messages": HI})
        assert status == 400 and "empty prompt" in body["error"]["message"]


# ---------------------------------------------------------------------------- property test

EXPRESSIONS = ["messages[0].content", "m.content", "m.role", "loop.index", "'ab' * 3", "i", "ns.n",
               "messages|length", "m.content|upper", "(m.content ~ 'x')|replace('x', 'yy')",
               "m.content.split(' ')|join('-')", "range(3)|list", "m.missing", "messages[9]",
               "m.content|tojson", "raise_exception('no')", "1 / 0", "m.content * 2", "ns.n + 1",
               "m.content[1:]", "'%5d' % 3", "m.content|center(7)", "bos_token", "messages|sort"]
pieces = st.recursive(
    st.sampled_from(EXPRESSIONS).map(lambda e: "{{ " + e + " }}") | st.text("ab <|>", max_size=4),
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        inner.map(lambda body: "{% for m in messages %}" + body + "{% endfor %}"),
        inner.map(lambda body: "{% for i in range(3) %}" + body + "{% endfor %}"),
        inner.map(lambda body: "{% if m is defined and m.role == 'user' %}" + body + "{% endif %}"),
        inner.map(lambda body: "{% set ns.n = ns.n + 1 %}" + body),
        inner.map(lambda body: "{% macro f() %}" + body + "{% endmacro %}{{ f() }}"),
    ), max_leaves=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text(max_size=12)}), min_size=1, max_size=4)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(body=pieces, conversation=messages)
def test_random_templates_give_a_string_or_a_template_error(body, conversation):
    source = "{% set ns = namespace(n=0) %}" + body
    try:
        text = ChatTemplate(source, TOKENIZER).render(conversation)
    except TemplateError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(text, str) and text
