// The sampling controls: one line per request field. A field is sent only when its box
// holds something other than `unset` (the server's own default, or empty), so a control
// left alone sends nothing: the request is what the server would do anyway, and a server
// that does not know a field yet never sees it. Adding a field is one line here.
//
//   field  the request's name (OpenAI's, or vLLM's extra)
//   kind   "number", "integer", or "lines" (one string a line: the stop strings)
//   value  what the box starts with; unset: the value that is not sent ("" if absent)

export const CONTROLS = [
  {field: "max_tokens", kind: "integer", value: 64, min: 1},
  {field: "temperature", kind: "number", value: 0.8, unset: 1, min: 0, max: 2, step: 0.1,
    hint: "0: greedy"},
  {field: "top_k", kind: "integer", min: -1, hint: "empty or -1: off"},
  {field: "top_p", kind: "number", value: 1, unset: 1, min: 0, max: 1, step: 0.05},
  {field: "min_p", kind: "number", value: 0, unset: 0, min: 0, max: 1, step: 0.01},
  {field: "presence_penalty", kind: "number", value: 0, unset: 0, min: -2, max: 2, step: 0.1},
  {field: "frequency_penalty", kind: "number", value: 0, unset: 0, min: -2, max: 2, step: 0.1},
  {field: "repetition_penalty", kind: "number", value: 1, unset: 1, min: 0.1, max: 2, step: 0.05},
  {field: "seed", kind: "integer", hint: "empty: a new draw each time"},
  {field: "stop", kind: "lines", hint: "one a line; \\n is a newline"},
  {field: "structured_outputs", kind: "json",
    hint: '{"choice": ["yes", "no"]}, {"regex": "[0-9]+"} or {"json": {a JSON schema}}'},
];

// The boxes, in `form`, one labelled row each.
export function drawControls(form) {
  for (const control of CONTROLS) {
    const row = document.createElement("label");
    row.className = "control";
    const name = document.createElement("span");
    name.textContent = control.field;
    const textual = control.kind === "lines" || control.kind === "json";
    const box = document.createElement(textual ? "textarea" : "input");
    box.name = control.field;
    if (!textual) {
      box.type = "number";
      box.step = control.step ?? (control.kind === "integer" ? 1 : "any");
      if (control.min !== undefined) box.min = control.min;
      if (control.max !== undefined) box.max = control.max;
    } else {
      box.rows = 2;
    }
    box.value = control.value ?? "";
    row.append(name, box);
    if (control.hint) {
      const hint = document.createElement("small");
      hint.textContent = control.hint;
      row.append(hint);
    }
    form.append(row);
  }
}

// The request's fields from the boxes: {field: value} for every box not at its unset value.
export function readControls(form) {
  const fields = {};
  for (const control of CONTROLS) {
    const text = form.elements[control.field].value;
    if (text.trim() === String(control.unset ?? "")) continue;
    if (control.kind === "lines") {
      const lines = text.split("\n").filter((line) => line !== "").map(unescape);
      if (lines.length) fields[control.field] = lines;
    } else if (control.kind === "json") {
      fields[control.field] = parsedOrText(text);
    } else {
      const value = Number(text);
      if (value !== Number(control.unset ?? NaN)) fields[control.field] = value;
    }
  }
  return fields;
}

// The JSON a box holds; text that is not JSON goes as it is, and the server's 400 says why.
function parsedOrText(text) {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

// "\n" and "\t" typed as two characters become the characters; "\\" a backslash.
function unescape(line) {
  return line.replace(/\\([nt\\])/g, (_, c) => ({n: "\n", t: "\t", "\\": "\\"})[c]);
}
