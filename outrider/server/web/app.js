// outrider's web page: chat, race and model picker over the server's own API.
// Plain JS, no build step, no third-party code. Model output is inserted as text, never markup.
"use strict";

const KEY_STORE = "outrider.apiKey";
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

// ---- the API key and HTTP ---------------------------------------------------------------------

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers["x-api-key"] = key;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const j = await response.json();
      message = (j.error && j.error.message) || message;
    } catch (_) {
      /* not JSON */
    }
    if (response.status === 401) askForKey();
    throw new HttpError(response.status, message);
  }
  return response;
}

// The verdict's words where two outputs part: each side's token there, or one ending first.
function differs(d) {
  const at = `outputs differ from token ${d.first_difference}`;
  if (d.length_only) return `${at}: one arm stopped earlier`;
  const show = (t) => (t ? JSON.stringify(t.text) : "its end");
  const lead = d.margin === undefined ? ""
    : ` (the target prefers the first by ${d.at_least ? "at least " : ""}${d.margin.toFixed(3)} in log-probability)`;
  return `${at}: ${show(d.reference_token)} against ${show(d.arm_token)}${lead}`;
}

function errorText(err) {
  if (err instanceof HttpError && err.status === 401) {
    return "Wrong API key: the server refused it (401).";
  }
  return err && err.message ? err.message : String(err);
}

// Server-sent events from a fetch response: {event, data} per block.
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

function askForKey() {
  const panel = $("key-panel");
  const error = $("key-error");
  if (apiKey()) {
    error.textContent =
      "Wrong API key: the server refused it (401). Enter the key the server was started with.";
    error.hidden = false;
  } else {
    error.hidden = true;
  }
  panel.hidden = false;
  document.body.dataset.auth = "needed";
}

function setupKey() {
  $("key-button").addEventListener("click", () => {
    $("key-panel").hidden = !$("key-panel").hidden;
    $("key-input").focus();
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    $("key-input").value = "";
    $("key-error").hidden = true;
    if (await refreshHealth()) {
      $("key-panel").hidden = true;
      if (!$("view-models").hidden) loadModels();
    }
  });
  $("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    $("key-error").hidden = true;
    refreshHealth();
  });
}

// ---- server status in the header ---------------------------------------------------------------

let health = null;

async function refreshHealth() {
  const box = $("server-status");
  try {
    health = await (await api("/health")).json();
  } catch (err) {
    box.dataset.status = err instanceof HttpError && err.status === 401 ? "locked" : "error";
    $("model-name").textContent =
      err instanceof HttpError && err.status === 401 ? "API key needed" : "server unreachable";
    $("model-mode").textContent = "";
    return false;
  }
  document.body.dataset.auth = "ok";
  box.dataset.status = health.status;
  const names = { ok: health.model, loading: "loading…", no_model: "no model loaded" };
  $("model-name").textContent = names[health.status] || health.status;
  $("model-mode").textContent =
    health.status === "ok" ? `${health.mode} · max_draft ${health.max_draft}` : "";
  return true;
}

// ---- telemetry: speed, accept length and the acceptance ribbon ----------------------------------

const RIBBON_LIMIT = 600;

function ribbonBlock(drafted, accepted) {
  if (drafted <= 0) return el("span", "blk none", "·");
  const frac = Math.min(Math.max(accepted / drafted, 0), 1);
  const b = el("span", `blk h${Math.round(frac * 7)} c${Math.round(frac * 4)}`);
  b.title = `${accepted} of ${drafted} drafted tokens kept`;
  return b;
}

function addRibbon(ribbon, rounds) {
  for (const [drafted, accepted] of rounds) ribbon.append(ribbonBlock(drafted, accepted));
  while (ribbon.childElementCount > RIBBON_LIMIT) ribbon.firstElementChild.remove();
}

class Telemetry {
  constructor(stats, ribbon) {
    this.stats = stats;
    this.ribbon = ribbon;
    this.tokens = 0;
    this.rounds = 0;
    this.kept = 0; // accepted + 1 per round
    this.first = null;
    this.final = null;
  }

  add(report) {
    if (report.tokens) {
      if (this.first === null) this.first = performance.now();
      this.tokens += report.tokens;
    }
    for (const [drafted, accepted] of report.ribbon || []) {
      this.rounds += 1;
      this.kept += accepted + 1;
    }
    addRibbon(this.ribbon, report.ribbon || []);
    this.render();
  }

  finish(summary, usage) {
    this.final = summary;
    if (usage) this.tokens = usage.completion_tokens;
    this.render();
  }

  render() {
    const f = this.final;
    const elapsed = this.first === null ? 0 : (performance.now() - this.first) / 1000;
    const tps = f ? f.decode_tokens_per_sec : elapsed > 0 ? (this.tokens - 1) / elapsed : 0;
    const accept = f ? f.mean_accept_len : this.rounds ? this.kept / this.rounds : 0;
    const rounds = f ? f.rounds : this.rounds;
    const parts = [
      `${this.tokens} tokens`,
      `${Math.max(tps, 0).toFixed(1)} tok/s`,
      `accept ${accept ? accept.toFixed(2) : "—"}`,
      `${rounds} rounds`,
    ];
    if (f) parts.push(`${f.mode} · max_draft ${f.max_draft}`);
    if (f && f.budget_forced) parts.push("thinking closed by the budget");
    this.stats.textContent = parts.join(" · ");
    this.stats.dataset.final = f ? "yes" : "no";
  }
}

// ---- chat -----------------------------------------------------------------------------------------

const chat = { history: [], controller: null };

function bubble(role) {
  $("chat-empty").hidden = true;
  const node = el("div", `msg ${role}`);
  $("chat-log").append(node);
  return node;
}

function assistantBubble() {
  const node = bubble("assistant");
  const reasoning = el("details", "reasoning");
  reasoning.hidden = true;
  const summary = el("summary", null, "Reasoning");
  const reasoningText = el("div", "reasoning-text");
  reasoning.append(summary, reasoningText);
  const content = el("div", "content");
  const tools = el("div", "tool-calls");
  const meta = el("div", "telemetry");
  const stats = el("div", "stats");
  const ribbon = el("div", "ribbon");
  meta.append(stats, ribbon);
  node.append(reasoning, content, tools, meta);
  node.dataset.frames = "0";
  node.dataset.done = "no";
  return { node, reasoning, summary, reasoningText, content, tools, telemetry: new Telemetry(stats, ribbon) };
}

function showToolCall(box, call) {
  const item = el("div", "tool-call");
  const fn = call.function || {};
  item.append(el("span", "tool-label", "tool call"), el("span", "tool-name", fn.name || "?"));
  let args = fn.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch (_) {
    /* shown as sent */
  }
  item.append(el("pre", "tool-args", args));
  box.append(item);
}

function chatBody() {
  const body = {
    messages: chat.history,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("opt-max-tokens").value) || 1024,
  };
  // empty: the server's default (the model's recommended sampling, else greedy)
  const temperature = $("opt-temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const thinking = $("opt-thinking").value;
  if (thinking) body.enable_thinking = thinking === "on";
  // empty: the server's --reasoning-budget, if any
  const budget = $("opt-budget").value.trim();
  if (budget !== "") body.reasoning_budget = Number(budget);
  const tools = $("opt-tools").value.trim();
  if (tools) body.tools = JSON.parse(tools); // a SyntaxError is shown in the answer's place
  return body;
}

async function sendChat(text) {
  const user = bubble("user");
  user.append(el("div", "content", text));
  chat.history.push({ role: "user", content: text });
  const a = assistantBubble();
  const controller = new AbortController();
  chat.controller = controller;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let content = "";
  let reasoning = "";
  const calls = [];
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: chatBody(),
      signal: controller.signal,
    });
    for await (const ev of sse(response)) {
      if (ev.data === "[DONE]") break;
      const j = JSON.parse(ev.data);
      if (j.error) throw new Error(j.error.message);
      const choice = (j.choices || [])[0];
      if (choice) {
        const d = choice.delta || {};
        if (d.reasoning_content) {
          reasoning += d.reasoning_content;
          a.reasoning.hidden = false;
          a.reasoningText.textContent = reasoning;
        }
        if (d.content) {
          content += d.content;
          a.content.textContent = content;
        }
        for (const call of d.tool_calls || []) {
          calls.push(call);
          showToolCall(a.tools, call);
        }
        if (d.reasoning_content || d.content || d.tool_calls) {
          a.node.dataset.frames = String(Number(a.node.dataset.frames) + 1);
        }
        if (choice.finish_reason) a.node.dataset.finish = choice.finish_reason;
      }
      if (j.x_outrider) {
        a.telemetry.add(j.x_outrider);
        if (choice && choice.finish_reason) a.telemetry.final = j.x_outrider;
      }
      if (j.usage) a.telemetry.finish(a.telemetry.final, j.usage);
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
    }
    if (a.telemetry.final) a.telemetry.finish(a.telemetry.final);
    a.summary.textContent = `Reasoning (${reasoning.length} characters)`;
    const message = { role: "assistant", content };
    if (calls.length) message.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: c.function }));
    chat.history.push(message);
  } catch (err) {
    chat.history.pop(); // the turn failed: do not send it again
    const stopped = err && err.name === "AbortError";
    a.node.append(el("div", stopped ? "note" : "error", stopped ? "stopped" : errorText(err)));
    a.node.dataset.error = stopped ? "" : errorText(err);
  } finally {
    a.node.dataset.done = "yes";
    chat.controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function setupChat() {
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || chat.controller) return;
    $("chat-input").value = "";
    sendChat(text);
  });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("chat-new").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    for (const m of [...$("chat-log").querySelectorAll(".msg")]) m.remove();
    $("chat-empty").hidden = false;
  });
}

// ---- race -------------------------------------------------------------------------------------------

const race = { running: false, timer: null };

function fmtSpeedup(x) {
  return x && isFinite(x) ? `${x.toFixed(2)}×` : "—";
}

function armStats(node, s, live) {
  const parts = [`${s.tokens} tokens`, `${s.tps.toFixed(1)} tok/s`];
  if (s.accept) parts.push(`accept ${s.accept.toFixed(2)}`);
  node.textContent = parts.join(" · ") + (live ? " …" : "");
}

async function runRace() {
  const plainText = $("race-plain-text");
  const specText = $("race-spec-text");
  const ribbon = $("race-spec-ribbon");
  const verdict = $("race-verdict");
  const status = $("race-status");
  const speedup = $("race-speedup");
  for (const n of [plainText, specText, ribbon, $("race-plain-stats"), $("race-spec-stats")]) {
    n.textContent = "";
  }
  speedup.textContent = "—";
  verdict.textContent = "";
  verdict.dataset.state = "running";
  clearTimeout(race.timer);
  race.running = true;
  $("race-run").disabled = true;
  const plain = []; // token events of the left arm: {index, text, t_ms}
  let left = "plain"; // the left arm's name (the first of the start event's arms)
  let spec = { tokens: 0, rounds: 0, kept: 0, t: 0 };
  let ghost = null; // the plain arm's replay: {start, shown}
  const replay = () => {
    const now = performance.now() - ghost.start;
    let text = "";
    let n = 0;
    for (const p of plain) {
      if (p.t_ms > now) break;
      text += p.text;
      n = p.index;
    }
    plainText.textContent = text;
    if (n < plain[plain.length - 1].index) race.timer = setTimeout(replay, 16);
  };
  try {
    const body = {
      prompt: $("race-prompt").value,
      max_tokens: Number($("race-max-tokens").value) || 256,
    };
    const thinking = $("race-thinking").value;
    if (thinking) body.enable_thinking = thinking === "on";
    // another mode on the left, or the right arm at its own cap or confidence: the two arms
    // by mode (the loaded one on the right)
    const against = $("race-against").value;
    const cap = $("race-cap").value.trim();
    const confidence = $("race-confidence").value.trim();
    if (health && health.mode && (cap || confidence || (against && against !== health.mode))) {
      const right = { mode: health.mode };
      if (cap) right.cap = cap === "auto" ? "auto" : Number(cap);
      if (confidence) right.confidence = Number(confidence);
      const other = against && against !== health.mode;
      body.arms = [other ? against : { mode: health.mode, cap: 0 }, cap || confidence ? right : health.mode];
    }
    const response = await api("/admin/race", { method: "POST", body });
    for await (const ev of sse(response)) {
      const d = JSON.parse(ev.data);
      if (ev.event === "start") {
        left = d.arms[0];
        const plainLeft = left === "plain" || left === "baseline" || left.endsWith(" cap 0");
        $("race-plain-title").textContent = plainLeft ? "plain decoding" : left;
        $("race-spec-note").textContent = `${d.mode} · max_draft ${d.max_draft}`;
        status.textContent = `${d.model} · ${d.prompt_tokens} prompt tokens · up to ${d.max_tokens} new`;
      } else if (ev.event === "arm_start") {
        const note = d.arm === left ? "race-plain-note" : "race-spec-note";
        $(note).textContent = `${d.mode} · max_draft ${d.max_draft}`;
        const what = d.arm !== left ? "speculative decoding" : left === "plain" ? "plain decoding" : left;
        status.textContent = `running ${what}…`;
      } else if (ev.event === "token" && d.arm === left) {
        plain.push(d);
        plainText.textContent += d.text;
        const secs = d.t_ms / 1000;
        armStats($("race-plain-stats"), { tokens: d.index, tps: secs > 0 ? (d.index - 1) / secs : 0 }, true);
      } else if (ev.event === "token") {
        if (ghost === null && plain.length) {
          ghost = { start: performance.now() };
          replay();
        }
        specText.textContent += d.text;
        spec.tokens = d.index;
        spec.t = d.t_ms;
        if (d.round) {
          spec.rounds += 1;
          spec.kept += d.round.accepted + 1;
          addRibbon(ribbon, [[d.round.drafted, d.round.accepted]]);
        }
        const secs = d.t_ms / 1000;
        armStats($("race-spec-stats"), {
          tokens: d.index,
          tps: secs > 0 ? (d.index - 1) / secs : 0,
          accept: spec.rounds ? spec.kept / spec.rounds : 0,
        }, true);
        const reached = plain.find((p) => p.index >= d.index);
        if (reached && d.t_ms > 0) speedup.textContent = fmtSpeedup(reached.t_ms / d.t_ms);
      } else if (ev.event === "arm_done") {
        const node = d.arm === left ? $("race-plain-stats") : $("race-spec-stats");
        armStats(node, {
          tokens: d.tokens,
          tps: d.tokens_per_sec,
          accept: d.arm === left ? 0 : d.accept_len,
        }, false);
      } else if (ev.event === "verdict") {
        speedup.textContent = fmtSpeedup(d.speedup);
        verdict.dataset.state = d.identical ? "identical" : "different";
        verdict.textContent = d.identical ? "identical text ✓" : differs(d);
        status.textContent = "done";
      } else if (ev.event === "error") {
        throw new Error(d.message);
      }
    }
  } catch (err) {
    verdict.dataset.state = "error";
    verdict.textContent = errorText(err);
    status.textContent = "";
  } finally {
    race.running = false;
    $("race-run").disabled = false;
  }
}

function setupRace() {
  $("race-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (!race.running) runRace();
  });
}

// ---- model picker -----------------------------------------------------------------------------------

function modelHead(table, names) {
  const tr = el("tr");
  for (const n of [...names, ""]) tr.append(el("th", null, n));
  const head = el("thead");
  head.append(tr);
  table.append(head);
}

function modelRow(table, cells, ref, local) {
  const tr = el("tr");
  for (const c of cells) tr.append(el("td", null, c));
  const td = el("td");
  const button = el("button", "small", local ? "Load" : "Download & load");
  button.type = "button";
  button.dataset.ref = ref;
  button.addEventListener("click", () => loadModel(ref, $("load-mode").value));
  td.append(button);
  tr.append(td);
  table.append(tr);
}

async function loadModels() {
  let j;
  try {
    j = await (await api("/admin/models")).json();
  } catch (err) {
    $("load-error").textContent = errorText(err);
    $("load-error").hidden = false;
    return;
  }
  const current = $("model-current");
  current.textContent = "";
  if (j.loaded) {
    current.append(el("div", "current-name", j.loaded.model));
    const bits = [`mode ${j.loaded.mode}`, `max_draft ${j.loaded.max_draft}`];
    if (j.loaded.drafter) bits.push(`drafter ${j.loaded.drafter}`);
    current.append(el("div", "dim", bits.join(" · ")), el("div", "dim small", j.loaded.ref));
  } else {
    current.append(el("div", "current-name dim", "no model loaded"));
  }
  const mode = $("load-mode");
  const chosen = mode.value;
  mode.textContent = "";
  for (const m of j.modes) mode.append(el("option", null, m));
  mode.value = j.modes.includes(chosen) ? chosen : "auto";
  const local = $("models-local");
  local.textContent = "";
  if (!j.local.length) {
    const tr = el("tr");
    tr.append(el("td", "dim", "none found in the Hugging Face cache or LM Studio's folders"));
    local.append(tr);
  } else {
    modelHead(local, ["model", "found in"]);
  }
  for (const m of j.local) modelRow(local, [m.name, m.source], m.ref, true);
  const registry = $("models-registry");
  registry.textContent = "";
  modelHead(registry, ["✓", "id", "target", "mode", "size", "fits here", "published speed-up"]);
  const fits = { true: "yes", false: "no" };
  for (const r of j.registry) {
    const size = r.size_gb ? gigabytes(r.size_gb * 1e9) : "?";
    const cells = [r.local ? "✓" : "", r.id, r.ref, r.mode, size, fits[r.fits] || "?", r.speedup || "—"];
    modelRow(registry, cells, r.ref, r.local);
  }
}

function gigabytes(n) {
  return n >= 1e9 ? `${(n / 1e9).toFixed(1)} GB` : `${(n / 1e6).toFixed(1)} MB`;
}

// " · 3.2 of 16.4 GB (19%) · 2 of 9 files" while /health reports a download, else "".
function downloadText(d) {
  if (!d) return "";
  let text = d.bytes_total
    ? ` · ${gigabytes(d.bytes_done)} of ${gigabytes(d.bytes_total)} (${Math.floor(100 * d.fraction)}%)`
    : ` · ${gigabytes(d.bytes_done)}`;
  if (d.files_total) text += ` · ${d.files_done} of ${d.files_total} files`;
  return d.what === "drafter" ? ` · drafter${text}` : text;
}

// The determinate bar while a download's size is known; the sliding one otherwise.
function showDownload(d) {
  const known = Boolean(d && d.bytes_total);
  const bar = $("load-download");
  bar.hidden = !known;
  $("load-spinner").hidden = known;
  if (known) bar.value = d.fraction || 0;
}

async function loadModel(ref, mode) {
  const error = $("load-error");
  error.hidden = true;
  $("load-warning").hidden = true;
  try {
    await api("/admin/load", { method: "POST", body: { model: ref, mode } });
  } catch (err) {
    error.textContent = errorText(err);
    error.hidden = false;
    return;
  }
  $("load-progress").hidden = false;
  $("load-cancel").hidden = false;
  for (;;) {
    let h;
    try {
      h = await (await api("/health")).json();
    } catch (err) {
      error.textContent = errorText(err);
      error.hidden = false;
      break;
    }
    const load = h.load || {};
    if (h.status !== "loading") {
      if (load.error) {
        error.textContent = load.error;
        error.hidden = false;
      }
      break;
    }
    const elapsed = load.elapsed_s ? ` · ${load.elapsed_s.toFixed(1)} s` : "";
    $("load-phase").textContent =
      `loading ${ref} · ${load.phase || "queued"}${downloadText(load.download)}${elapsed}`;
    showDownload(load.download);
    if (load.warning) {
      $("load-warning").textContent = `warning: ${load.warning}`;
      $("load-warning").hidden = false;
    }
    await new Promise((r) => setTimeout(r, 300));
  }
  showDownload(null);
  $("load-progress").hidden = true;
  $("load-cancel").hidden = true;
  await refreshHealth();
  await loadModels();
}

function setupModels() {
  $("load-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const ref = $("load-ref").value.trim();
    if (ref) loadModel(ref, $("load-mode").value);
  });
  $("load-cancel").addEventListener("click", () => api("/admin/load/cancel", { method: "POST" }).catch(() => {}));
}

// ---- views --------------------------------------------------------------------------------------------

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === view);
  }
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== `view-${view}`;
  if (view === "models") loadModels();
  refreshHealth();
}

document.addEventListener("DOMContentLoaded", () => {
  setupKey();
  setupChat();
  setupRace();
  setupModels();
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => show(tab.dataset.view));
  }
  refreshHealth();
});
