// The KV cache, live: GET /v1/cache (serving/cache_view.py) drawn as a grid, one cell a
// block of the paged pool. Polled every POLL_BUSY_MS while this tab streams a reply, every
// POLL_IDLE_MS otherwise, so that what other tabs (other clients) do shows up too.
//
//   free    nobody holds it, nothing to reuse     held    one running request holds it
//   cached  nobody holds it, but a prompt that    shared  several requests hold it: a
//           starts the same way reuses it                 prefix computed once
// A held block is coloured by the request holding it (the same colour in every tab);
// this tab's own request's blocks are outlined.

const POLL_BUSY_MS = 200;
const POLL_IDLE_MS = 1000;
const STATE_NAMES = {".": "free", c: "cached", h: "held", s: "shared"};
const OWNER_COLOURS = 8; // page.css has .owner-0 .. .owner-7

export class CacheView {
  // api: an Api; elements: {grid, counts, requests, formula, engine}, where it draws
  constructor(api, elements) {
    this.api = api;
    this.el = elements;
    this.view = null;
    this.busy = false; // this tab is streaming: poll fast
    this.mine = null; // this tab's latest reply id (cmpl-..., chatcmpl-...)
    this.timer = null;
    this.round = 0; // start() begins a new round of polls; a poll of an older one stops there
    elements.grid.addEventListener("mouseover", (event) => this.describeCell(event.target));
  }

  // Poll from now on, the first at once (when a reply starts or ends, when the key is given).
  start() {
    clearTimeout(this.timer);
    this.round += 1;
    this.poll(this.round);
  }

  async poll(round) {
    try {
      this.draw(await this.api.get("/v1/cache"));
    } catch (error) {
      this.el.counts.textContent = `cache view unavailable: ${error.message}`;
      if (error.status === 401) return; // until the key is given (start() again)
    }
    if (round !== this.round) return; // start() was called meanwhile: its round goes on
    this.timer = setTimeout(() => this.poll(round), this.busy ? POLL_BUSY_MS : POLL_IDLE_MS);
  }

  draw(view) {
    this.view = view;
    this.owners = cellOwners(view);
    this.drawGrid(view);
    const c = view.counts;
    this.el.counts.textContent = `${c.free} free \u00b7 ${c.cached} cached \u00b7 ${c.held} held `
      + `\u00b7 ${c.shared} shared, of ${view.formula.num_blocks} blocks`
      + (view.blocks_per_cell > 1 ? ` (a cell: ${view.blocks_per_cell} blocks, the busiest shown)` : "");
    this.drawRequests(view);
    const e = view.engine;
    const asked = e.prefilled_tokens + e.cached_tokens;
    this.el.engine.textContent = `${e.running} running, ${e.waiting} waiting, `
      + `${e.preemptions} preemptions; prefix cache: ${e.cached_tokens} of ${asked} prompt tokens `
      + `found cached${asked ? ` (${Math.round(100 * e.cached_tokens / asked)}%)` : ""}; `
      + `peak ${e.blocks_peak} blocks held`;
    this.el.formula.textContent = formulaText(view.formula);
  }

  isMine(request) {
    return request.id !== null && request.id === this.mine;
  }

  // One cell per letter of view.cells; a cell's class changes only when its state does.
  drawGrid(view) {
    const grid = this.el.grid;
    if (grid.children.length !== view.cells.length) {
      grid.replaceChildren(...Array.from(view.cells, () => document.createElement("span")));
    }
    Array.from(view.cells).forEach((letter, i) => {
      const owners = this.owners.get(i) ?? [];
      let name = `cell ${STATE_NAMES[letter]}`;
      if (letter === "h" && owners.length) name += ` owner-${colourOf(owners[0].id)}`;
      if (owners.some((r) => this.isMine(r))) name += " mine";
      const cell = grid.children[i];
      if (cell.className !== name) cell.className = name;
    });
  }

  drawRequests(view) {
    const rows = view.requests.map((r) => {
      const tr = document.createElement("tr");
      const swatch = document.createElement("span");
      swatch.className = `swatch owner-${colourOf(r.id)}`;
      const who = document.createElement("td");
      who.append(swatch, `${shortId(r.id)}${this.isMine(r) ? " (this tab)" : ""}`);
      const table = r.blocks.length > 12 ? `${r.blocks.slice(0, 12).join(" ")} \u2026` : r.blocks.join(" ");
      const cells = [r.state, `${r.prompt_tokens} + ${r.generated}`, r.cached_prompt_tokens ?? "",
        `[${table}]`];
      tr.append(who, ...cells.map((text) => {
        const td = document.createElement("td");
        td.textContent = text;
        return td;
      }));
      return tr;
    });
    if (view.requests_left_out) {
      const tr = document.createElement("tr");
      tr.insertCell().textContent = `and ${view.requests_left_out} more`;
      rows.push(tr);
    }
    this.el.requests.replaceChildren(...rows);
  }

  // A cell's title, made when the pointer reaches it: the block(s), their state, who holds them.
  describeCell(cell) {
    if (!this.view || !cell.classList.contains("cell")) return;
    const i = Array.prototype.indexOf.call(this.el.grid.children, cell);
    const per = this.view.blocks_per_cell;
    const tpb = this.view.formula.tokens_per_block;
    const first = 1 + i * per;
    const blocks = per > 1 ? `blocks ${first}-${first + per - 1}` : `block ${first}`;
    const state = STATE_NAMES[this.view.cells[i]];
    const holders = (this.owners.get(i) ?? []).map((r) => {
      const at = r.blocks.indexOf(first);
      const where = per === 1 && at >= 0 ? `, positions ${at * tpb}-${(at + 1) * tpb - 1}` : "";
      return `${shortId(r.id)}${this.isMine(r) ? " (this tab)" : ""}${where}`;
    });
    cell.title = `${blocks}: ${state}${holders.length ? `, held by ${holders.join("; ")}` : ""}`;
  }
}

// cell index -> the running requests holding a block in it
function cellOwners(view) {
  const owners = new Map();
  for (const r of view.requests) {
    if (r.state !== "running") continue;
    for (const block of r.blocks) {
      const cell = Math.floor((block - 1) / view.blocks_per_cell);
      if (!owners.has(cell)) owners.set(cell, []);
      if (!owners.get(cell).includes(r)) owners.get(cell).push(r);
    }
  }
  return owners;
}

// A colour per reply id, the same in every tab: a small hash of the id.
function colourOf(id) {
  let h = 0;
  for (const c of id ?? "") h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return h % OWNER_COLOURS;
}

function shortId(id) {
  return id === null ? "(no HTTP request)" : `${id.split("-")[0]}-${id.slice(-6)}`;
}

// The cache formula with this model's numbers (kv_quant.cache_bytes).
function formulaText(f) {
  return `per token: 2 (keys and values) \u00d7 ${f.n_layer} layers \u00d7 ${f.n_kv_head} KV heads `
    + `\u00d7 ${f.bytes_per_head} B a head (${f.head_dim} values, ${f.dtype}) = ${bytes(f.bytes_per_token)}; `
    + `per block of ${f.tokens_per_block} positions: ${bytes(f.bytes_per_block)}; `
    + `the pool: ${f.num_blocks} blocks + the null block = ${bytes(f.pool_bytes)}`;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}
