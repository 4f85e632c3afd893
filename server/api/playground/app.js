// The playground: several prompts streamed at once through the OpenAI API, and the live KV block map.
import { KVMap } from "./kvmap.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pagewalk.apiKey";
const DEFAULT_PROMPTS = ["The paged KV cache keeps every sequence in fixed-size blocks, so"];
const running = new Set(); // AbortControllers of the requests in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// Server-sent events of a fetch response: yields each event's data (the lines after "data: ", joined).
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error?.message ?? JSON.stringify(body)}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ---- prompts and sampling ------------------------------------------------------------------------------
function addPrompt(text = "") {
  const node = $("prompt-tpl").content.firstElementChild.cloneNode(true);
  node.querySelector("textarea").value = text;
  node.querySelector(".remove").addEventListener("click", () => node.remove());
  node.querySelector("textarea").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) runAll();
  });
  $("prompts").append(node);
  return node;
}

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function requestBody(prompt, chat) {
  const body = {
    stream: true, stream_options: { include_usage: true },
    temperature: numberField("temperature"), top_p: numberField("top_p"), max_tokens: numberField("max_tokens"),
    n: numberField("n"), seed: numberField("seed"), ignore_eos: $("ignore_eos").checked,
  };
  // the served model once /v1/models named it; before that (a key just typed) none: the server's own
  if ($("model").dataset.id) body.model = $("model").dataset.id;
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  return body;
}

// ---- one request: its output cards, TTFT and tokens/s --------------------------------------------------
class RequestView {
  constructor(label, prompt, n, chat) {
    this.start = performance.now();
    this.cards = [];
    for (let i = 0; i < n; i++) {
      const card = document.createElement("div");
      card.className = "output running";
      card.innerHTML = `<div class="head"><span class="who"></span><span class="state">waiting</span>` +
        `<span class="stats"></span></div><pre></pre>`;
      card.querySelector(".who").textContent = n > 1 ? `${label} · choice ${i}` : label;
      const pre = card.querySelector("pre");
      if (!chat) {
        const echo = document.createElement("span");
        echo.className = "prompt-echo";
        echo.textContent = prompt;
        pre.append(echo);
      }
      const text = document.createElement("span");
      text.className = "completion";
      pre.append(text);
      $("outputs").prepend(card);
      this.cards.push({ card, text, tokens: 0, first: null, last: null, finish: null });
    }
  }

  // The response id names the request in the block map: each card takes its sequence's colour there.
  identify(id) {
    if (this.id) return;
    this.id = id;
    this.cards.forEach((c, i) => {
      const swatch = document.createElement("i");
      swatch.className = "sw";
      swatch.style.background = kvmap.colourOf(`${id}#${i}`);
      swatch.title = `${id}#${i}`;
      c.card.querySelector(".who").prepend(swatch);
    });
  }

  chunk(index, text) {
    const c = this.cards[index];
    if (!c) return;
    const now = performance.now();
    if (c.first === null) c.first = now;
    c.last = now;
    c.tokens += 1;
    c.text.textContent += text;
    this.render(c);
  }

  finish(index, reason) {
    const c = this.cards[index];
    if (!c) return;
    c.finish = reason;
    c.card.classList.remove("running");
    c.card.classList.add("done");
    this.render(c);
  }

  // An error, a stop or a broken stream ends the choices still running; a finished one keeps its finish.
  fail(message) {
    for (const c of this.cards) {
      if (c.finish !== null) continue;
      c.finish = "error";
      c.card.classList.remove("running");
      c.card.classList.add("error", "done");
      c.text.textContent += `\n[${message}]`;
      c.card.querySelector(".state").textContent = "error";
    }
  }

  render(c) {
    const ttft = c.first === null ? "" : `TTFT ${(c.first - this.start).toFixed(0)} ms`;
    const secs = c.first !== null && c.last > c.first ? (c.last - c.first) / 1000 : 0;
    const rate = secs > 0 ? ` · ${((c.tokens - 1) / secs).toFixed(1)} tok/s` : "";
    c.card.querySelector(".stats").textContent = `${ttft}${rate} · ${c.tokens} chunks`;
    c.card.querySelector(".state").textContent = c.finish ? `finish: ${c.finish}` : "streaming";
  }
}

async function runPrompt(prompt, label) {
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  const body = requestBody(prompt, chat);
  const view = new RequestView(label, prompt, body.n || 1, chat);
  const ctrl = new AbortController();
  running.add(ctrl);
  try {
    const url = chat ? "/v1/chat/completions" : "/v1/completions";
    const r = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body), signal: ctrl.signal });
    if (!r.ok) { view.fail(await errorMessage(r)); return; }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { view.fail(chunk.error.message); break; }
      if (chunk.id) view.identify(chunk.id);
      for (const c of chunk.choices || []) {
        const text = chat ? c.delta?.content : c.text;
        if (text) view.chunk(c.index, text);
        if (c.finish_reason) view.finish(c.index, c.finish_reason);
      }
    }
    view.fail("the stream ended before its choices finished"); // (none left running after [DONE])
  } catch (e) {
    view.fail(e.name === "AbortError" ? "stopped" : String(e));
  } finally {
    running.delete(ctrl);
  }
}

let numRequests = 0;

function runAll() {
  const prompts = [...document.querySelectorAll("#prompts textarea")].map((t) => t.value).filter((t) => t.trim());
  prompts.forEach((p, i) => runPrompt(p, `request ${++numRequests} (prompt ${i + 1})`));
}

// ---- the live block map --------------------------------------------------------------------------------
const kvmap = new KVMap($("kv-map"), $("kv-tip"));
let kvCtrl = null;
let updates = 0;

function showSnapshot(snap) {
  const s = kvmap.update(snap);
  $("kv-used").textContent = s.used;
  $("kv-shared").textContent = s.shared;
  $("kv-cached").textContent = s.cached;
  $("kv-free").textContent = s.free;
  $("kv-total").textContent = snap.num_blocks;
  $("kv-block-size").textContent = snap.block_size;
  $("kv-running").textContent = snap.running ?? "?";
  $("kv-waiting").textContent = snap.waiting ?? "?";
  $("kv-preemptions").textContent = snap.totals?.preemptions ?? "?";
  $("kv-scale").textContent = s.per === 1 ? "1 cell = 1 block" : `1 cell = ${s.per} blocks`;
  const seqs = $("kv-seqs");
  seqs.replaceChildren(...s.owners.map((o) => {
    const el = document.createElement("span");
    el.innerHTML = `<i class="sw"></i>`;
    el.firstChild.style.background = o.colour;
    el.append(`${o.key}: ${o.blocks} blocks`);
    return el;
  }));
  showSteps(snap.totals);
  updates += 1;
  document.body.dataset.kvUpdates = String(updates);
}

// What ran between two maps, from the engine's running totals: the maps differ only when steps ran.
const history = [];
let lastTotals = null;

function showSteps(totals) {
  if (!totals) return;
  if (lastTotals) {
    const delta = {
      time: new Date().toLocaleTimeString(),
      generated: totals.generated_tokens - lastTotals.generated_tokens,
      prefill: totals.prefill_tokens - lastTotals.prefill_tokens,
      preemptions: totals.preemptions - lastTotals.preemptions,
    };
    if (delta.generated || delta.prefill || delta.preemptions) history.push(delta);
    if (history.length > 8) history.shift();
  }
  lastTotals = totals;
  if (!history.length) return;
  const rows = history.slice().reverse().map((d) => {
    const tr = document.createElement("tr");
    for (const v of [d.time, d.generated, d.prefill, d.preemptions]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.append(td);
    }
    return tr;
  });
  $("kv-steps").tBodies[0].replaceChildren(...rows);
}

// Nobody watches a hidden tab: it holds no stream, so the engine builds no maps for it.
const watching = () => $("live").checked && !document.hidden;

let kvGeneration = 0; // bumped by every (re)start: an older watch loop sees it and ends

async function watchKV() {
  const generation = ++kvGeneration;
  const current = () => generation === kvGeneration && watching();
  while (current()) {
    const ctrl = kvCtrl = new AbortController();
    try {
      const r = await fetch("/debug/kvcache/stream", { headers: headers(), signal: ctrl.signal });
      if (!r.ok) {
        $("kv-status").textContent = await errorMessage(r);
      } else {
        $("kv-status").textContent = "live";
        for await (const data of sseData(r)) {
          const snap = JSON.parse(data);
          if (snap.error) $("kv-status").textContent = `${snap.error.message}; retrying`;
          else showSnapshot(snap);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") return;
      $("kv-status").textContent = `disconnected (${e.message}); retrying`;
    }
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

function restartKV() {
  kvGeneration++;
  if (kvCtrl) kvCtrl.abort();
  if (watching()) watchKV();
  else $("kv-status").textContent = document.hidden ? "paused (tab hidden)" : "paused";
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) { $("model").textContent = `model: ${await errorMessage(r)}`; return; }
    const id = (await r.json()).data?.[0]?.id;
    $("model").dataset.id = id;
    $("model").textContent = `model: ${id}`;
  } catch (e) {
    $("model").textContent = `model: ${e.message}`;
  }
}

// ---- wiring --------------------------------------------------------------------------------------------
// the key lives as long as the tab, never on disk (in localStorage it outlived the browser: a review)
$("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
  loadModel();
  restartKV();
});
$("add-prompt").addEventListener("click", () => addPrompt().querySelector("textarea").focus());
$("run").addEventListener("click", runAll);
$("stop").addEventListener("click", () => running.forEach((c) => c.abort()));
$("live").addEventListener("change", restartKV);
document.addEventListener("visibilitychange", restartKV);
DEFAULT_PROMPTS.forEach((p) => addPrompt(p));
window.playground = { kvmap, addPrompt, runAll, showSnapshot };
loadModel();
watchKV();
