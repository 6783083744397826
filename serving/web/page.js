// The page's wiring: the two modes (completion, chat) over the server's streaming
// endpoints, the prompt's tokens from /tokenize, the reply's tokens and timings as they
// stream, the stop button, and the cache view (cache.js) polled beside them.

import {Api} from "./api.js";
import {CacheView} from "./cache.js";
import {drawControls, readControls} from "./controls.js";
import {TokenView, chatTokens, completionTokens} from "./tokens.js";

const TOP_LOGPROBS = 5; // alternatives shown on hover
const $ = (id) => document.getElementById(id);

const api = new Api(askForKey);
const cache = new CacheView(api, {
  grid: $("cache-grid"), counts: $("cache-counts"), requests: $("cache-requests"),
  formula: $("cache-formula"), engine: $("cache-engine"),
});
const promptTokens = new TokenView($("prompt-tokens"), $("tooltip"));
const replyTokens = new TokenView($("reply-tokens"), $("tooltip"));
const messages = []; // the chat so far: [{role, content}]
let streaming = null; // the AbortController of the reply being streamed

// ------------------------------------------------------------------ starting, the key

async function start() {
  let model; // /v1/cache's "model": name, context_len, chat_template
  try {
    model = (await api.get("/v1/cache")).model;
  } catch (error) {
    if (error.status !== 401) showError(error.message); // a 401 shows the key form instead
    return; // the key form's button starts again
  }
  $("model-name").textContent = `${model.name}, context ${model.context_len} tokens`;
  const template = model.chat_template;
  $("template-note").textContent = template
    ? `chat template: ${template.origin}; a turn ends at `
      + `${template.end_of_turn.length ? template.end_of_turn.join(", ") : "end of text (or a stop string)"}`
    : "This model has no chat template (the bundled one is a plain language model): chat needs "
      + "serve.py --chat-template FILE, e.g. docs/clients/shakespeare_chat.jinja.";
  document.querySelector("input[value=chat]").disabled = !template;
  cache.start();
}

// The server's 401 message is written for API clients; the page says it in its own words.
function askForKey() {
  $("key-note").textContent = api.key
    ? "The server refused that key; try again:"
    : "This server wants its API key (serve.py --api-key or $KVCACHE_API_KEY):";
  $("key-form").hidden = false;
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  api.key = $("api-key").value;
  $("key-form").hidden = true;
  showError("");
  start();
});

// ------------------------------------------------------------------ the modes

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", () => {
    $("system").hidden = mode() !== "chat";
    clear();
  });
}

function clear() {
  streaming?.abort();
  messages.length = 0;
  $("conversation").replaceChildren();
  promptTokens.clear();
  replyTokens.clear();
  showError("");
}

// A block of text in the conversation: a chat message, or a completion's prompt and reply.
function addText(className, label, text = "") {
  const block = document.createElement("div");
  block.className = className;
  if (label) {
    const name = document.createElement("b");
    name.textContent = label;
    block.append(name);
  }
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text; // model output and prompts alike: text, never HTML
  block.append(body);
  $("conversation").append(block);
  return body;
}

// Runs grow() and keeps the conversation scrolled to its end, unless the reader had scrolled
// up to read something earlier (then it stays where they are).
function followingTheEnd(grow) {
  const box = $("conversation");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 2;
  grow();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

// What to send: the endpoint, the body, and what /tokenize is asked for the prompt's tokens.
function buildRequest(text) {
  const fields = {...readControls($("controls")), stream: true,
    stream_options: {include_usage: true}};
  if (mode() === "completion") {
    return {path: "/v1/completions", tokenize: {prompt: text},
      body: {prompt: text, logprobs: TOP_LOGPROBS, ...fields}};
  }
  const system = $("system").value.trim();
  const conversation = [...(system ? [{role: "system", content: system}] : []), ...messages,
    {role: "user", content: text}];
  return {path: "/v1/chat/completions", tokenize: {messages: conversation},
    body: {messages: conversation, logprobs: true, top_logprobs: TOP_LOGPROBS, ...fields}};
}

// ------------------------------------------------------------------ sending, streaming

async function send() {
  const text = $("prompt").value;
  if (streaming || !text) return;
  const request = buildRequest(text);
  const chat = mode() === "chat";
  showError("");
  replyTokens.clear();
  showPromptTokens(request.tokenize);
  $("conversation").replaceChildren();
  let reply;
  if (chat) {
    for (const m of request.body.messages) addText(`message ${m.role}`, m.role, m.content);
    reply = addText("message assistant", "assistant");
    $("prompt").value = "";
  } else {
    reply = document.createElement("span");
    reply.className = "reply";
    addText("document", null, text).after(reply); // the reply goes on from the prompt
  }
  const stats = new ReplyStats();
  streaming = new AbortController();
  setStreaming(true);
  let finish = "", failed = false;
  try {
    for await (const event of api.stream(request.path, request.body, streaming.signal)) {
      cache.mine = event.id;
      for (const choice of event.choices) {
        followingTheEnd(() => { reply.textContent += chat ? (choice.delta.content ?? "") : choice.text; });
        const tokens = chat ? chatTokens(choice.logprobs) : completionTokens(choice.logprobs);
        for (const token of tokens) replyTokens.add(token);
        stats.tokens(tokens.length);
        finish = choice.finish_reason ?? finish;
      }
      if (event.usage) stats.usage(event.usage);
    }
  } catch (error) {
    failed = error.name !== "AbortError"; // aborted: the stop button
    if (failed) showError(error.message);
    else finish = "stopped";
  } finally {
    streaming = null;
    setStreaming(false);
    stats.finish(finish);
  }
  if (failed) {
    if (chat) $("prompt").value = text; // to send again once corrected
  } else if (chat) {
    messages.push({role: "user", content: text}, {role: "assistant", content: reply.textContent});
  } else {
    // the prompt box now holds prompt and reply: send it again to go on (its prefix is cached)
    $("prompt").value = text + reply.textContent;
  }
}

async function showPromptTokens(body) {
  promptTokens.clear();
  $("prompt-count").textContent = "";
  try {
    const answer = await api.post("/tokenize", {...body, return_token_strs: true});
    answer.tokens.forEach((id, i) => promptTokens.add({text: answer.token_strs[i], logprob: null, top: [], id}));
    $("prompt-count").textContent = `(${answer.count})`;
  } catch {
    // the reply's own request reports what is wrong with the prompt
  }
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  cache.busy = on;
  cache.start(); // a poll now, then at the new pace
}

// Time to first token and tokens/s as this page sees them (the network included); the
// cached prompt tokens as the server reports them (usage.prompt_tokens_details).
class ReplyStats {
  constructor() {
    this.sent = performance.now();
    this.first = this.last = null;
    this.count = 0;
    for (const id of ["ttft", "rate", "tokens", "cached", "finish"]) $(`stat-${id}`).textContent = "";
  }

  tokens(n) {
    if (!n) return;
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.count += n;
    $("stat-ttft").textContent = `${(this.first - this.sent).toFixed(0)} ms`;
    $("stat-tokens").textContent = `${this.count}`;
    if (this.count > 1 && this.last > this.first) {
      const rate = (this.count - 1) / ((this.last - this.first) / 1000);
      $("stat-rate").textContent = `${rate.toFixed(0)}`;
    }
  }

  usage(usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens;
    $("stat-cached").textContent = `${cached ?? "?"} of ${usage.prompt_tokens}`;
  }

  finish(reason) {
    $("stat-finish").textContent = reason;
  }
}

function showError(message) {
  $("error").textContent = message;
}

$("prompt-form").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => streaming?.abort());
$("clear").addEventListener("click", clear);
drawControls($("controls"));
start();
