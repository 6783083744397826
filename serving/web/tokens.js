// Tokens made visible: the reply as the tokens the model chose, each shaded by the
// probability it gave that token, its likeliest alternatives on hover; the prompt as the
// tokens the model reads (after the chat template). Every piece of text a token carries is
// put in the page as text (textContent), never parsed as HTML: a model that writes
// "<script>" shows those eight characters.
//
// A token here is {text, logprob, top: [{text, logprob}]} (logprob null for prompt tokens),
// read from either endpoint's logprobs.

// The tokens of one /v1/completions chunk: logprobs.tokens, token_logprobs, top_logprobs
// (an object keyed by each alternative's text, the chosen token among them).
export function completionTokens(logprobs) {
  if (!logprobs) return [];
  return logprobs.tokens.map((text, i) => ({
    text, logprob: logprobs.token_logprobs[i],
    top: Object.entries(logprobs.top_logprobs[i] ?? {}).map(([t, logprob]) => ({text: t, logprob})),
  }));
}

// The tokens of one /v1/chat/completions chunk: logprobs.content[], each with top_logprobs.
export function chatTokens(logprobs) {
  return (logprobs?.content ?? []).map((entry) => ({
    text: entry.token, logprob: entry.logprob,
    top: entry.top_logprobs.map((alt) => ({text: alt.token, logprob: alt.logprob})),
  }));
}

// A token's text as a box shows it: a newline as a visible mark (then the line break).
function shownText(text) {
  return text.replaceAll("\n", "\u21b5\n");
}

export class TokenView {
  // element: where the boxes go; tooltip: the element shown over a box on hover
  constructor(element, tooltip) {
    this.element = element;
    this.tooltip = tooltip;
    this.tokens = [];
    element.addEventListener("mouseover", (event) => this.hover(event.target));
    element.addEventListener("mouseleave", () => { this.tooltip.hidden = true; });
  }

  clear() {
    this.tokens = [];
    this.element.replaceChildren();
  }

  add(token) {
    const box = document.createElement("span");
    box.className = "token";
    box.textContent = shownText(token.text);
    box.dataset.index = this.tokens.length;
    if (token.logprob !== null && token.logprob !== undefined) {
      // --p: the token's probability, which page.css turns into the box's colour
      box.style.setProperty("--p", Math.exp(token.logprob).toFixed(3));
    } else {
      box.classList.add("unscored");
    }
    this.tokens.push(token);
    this.element.append(box);
  }

  // The tooltip for the box under the pointer: the token, its probability, the alternatives.
  hover(box) {
    if (!box.classList.contains("token")) return;
    const token = this.tokens[Number(box.dataset.index)];
    const rows = [[JSON.stringify(token.text), probability(token.logprob), "chosen"]];
    const others = token.top.filter((alt) => alt.text !== token.text)
      .sort((a, b) => b.logprob - a.logprob);
    for (const alt of others) rows.push([JSON.stringify(alt.text), probability(alt.logprob), ""]);
    if (token.logprob === null || token.logprob === undefined) {
      rows[0][1] = "prompt";
      rows[0][2] = token.id === undefined ? "" : `token ${token.id}`;
    }
    const table = document.createElement("table");
    for (const cells of rows) {
      const tr = table.insertRow();
      for (const cell of cells) tr.insertCell().textContent = cell;
    }
    this.tooltip.replaceChildren(table);
    const place = box.getBoundingClientRect();
    this.tooltip.style.left = `${place.left + window.scrollX}px`;
    this.tooltip.style.top = `${place.bottom + window.scrollY + 4}px`;
    this.tooltip.hidden = false;
  }
}

function probability(logprob) {
  return logprob === null || logprob === undefined ? "" : `${(100 * Math.exp(logprob)).toFixed(1)}%`;
}
