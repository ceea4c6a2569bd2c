// fdx serve's page: a chat playground over /v1/chat/completions (streamed)
// and a live view of the engine from /v1/engine/stats. No build step, no
// third-party code: served from the package (entrypoints/serving/static/).
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("api-key");
keyInput.value = localStorage.getItem("fdx.apiKey") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("fdx.apiKey", keyInput.value.trim()); refreshModel(); });

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = keyInput.value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `HTTP ${resp.status}`;
}

// -- status line ------------------------------------------------------------------
let modelId = null;

async function refreshHealth() {
  const pill = $("health");
  try {
    const r = await fetch("/health", { cache: "no-store" });
    if (r.ok) { pill.textContent = "ready"; pill.className = "pill ok"; return; }
    const body = await r.json().catch(() => ({}));
    pill.textContent = (body.error && body.error.message) || `HTTP ${r.status}`;
    pill.className = "pill bad";
  } catch (_) { pill.textContent = "unreachable"; pill.className = "pill bad"; }
}

async function refreshModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false), cache: "no-store" });
    if (!r.ok) { $("model").textContent = await errorText(r); return; }
    const data = (await r.json()).data[0];
    modelId = data.id;
    $("model").textContent = `${data.id} - context ${data.max_model_len} tokens`;
  } catch (e) { $("model").textContent = String(e); }
}

// -- chat ---------------------------------------------------------------------------
const history = [];
let controller = null;

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  $("chat-error").textContent = "";
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.dataset.chunks = "0";
  out.dataset.done = "0";
  const body = { messages: history.slice(), stream: true, stream_options: { include_usage: true } };
  if (modelId) body.model = modelId;
  const t = $("temperature").value, m = $("max-tokens").value;
  if (t !== "") body.temperature = Number(t);             // unset: the model's / fdx's chat defaults
  if (m !== "") body.max_tokens = Number(m);
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let content = "", finish = null, usage = null, firstAt = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = (choice.delta && choice.delta.content) || "";
            if (piece) {
              if (firstAt === null) firstAt = performance.now();
              content += piece;
              out.textContent = content;
              out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
              $("messages").scrollTop = $("messages").scrollHeight;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("chat-error").textContent = String(e.message || e);
    finish = finish || (e.name === "AbortError" ? "stopped" : "error");
  } finally {
    controller = null;
    setBusy(false);
  }
  history.push({ role: "assistant", content });
  const meta = document.createElement("span");
  meta.className = "meta";
  const secs = (performance.now() - started) / 1000;
  const ttft = firstAt === null ? "" : `, first token ${((firstAt - started) / 1000).toFixed(2)} s`;
  const toks = usage ? `${usage.completion_tokens} tokens, ` : "";
  meta.textContent = `${toks}${secs.toFixed(1)} s${ttft}, finish: ${finish}`;
  out.appendChild(meta);
  out.dataset.finish = String(finish);
  out.dataset.done = "1";
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; });

// -- engine view ----------------------------------------------------------------------
const GRID_CELLS = 512;

function renderGrid(kv) {
  const grid = $("kv-grid");
  const cells = Math.max(1, Math.min(kv.total, GRID_CELLS));
  const per = Math.max(1, Math.ceil(kv.total / cells));
  while (grid.children.length < cells) grid.appendChild(document.createElement("i"));
  while (grid.children.length > cells) grid.removeChild(grid.lastChild);
  const share = (n) => (n > 0 ? Math.max(1, Math.round(n / per)) : 0);
  const used = Math.min(cells, share(kv.used));
  const cached = Math.min(cells - used, share(kv.cached));
  for (let i = 0; i < cells; i++) {
    grid.children[i].className = i < used ? "used" : i < used + cached ? "cached" : "";
  }
  grid.dataset.usedCells = String(used);
  grid.dataset.cachedCells = String(cached);
  $("kv-scale").textContent = per > 1 ? ` - one square is ${per} blocks` : " - one square is one block";
  $("kv-summary").textContent = `(${kv.used} used, ${kv.cached} cached, ${kv.free} free of ${kv.total} blocks of ${kv.block_size} tokens)`;
}

function drawBars(canvas, series, colors, spanS, now) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...series.map((s) => s.values.reduce((a, b) => a + b, 0)));
  const bw = w / spanS;
  for (const s of series) {
    let y = h;
    s.values.forEach((v, k) => {
      const bh = (v / max) * (h - 14);
      ctx.fillStyle = colors[k];
      ctx.fillRect(w - (now - s.t + 1) * bw, y - bh, Math.max(1, bw - 0.5), bh);
      y -= bh;
    });
  }
  ctx.fillStyle = "#6b6b70";
  ctx.font = "11px system-ui";
  ctx.fillText(`max ${Math.round(max)}`, 4, 11);
}

function drawLines(canvas, points, keys, colors, spanS, now) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...points.flatMap((p) => keys.map((k) => p[k])));
  keys.forEach((key, k) => {
    ctx.strokeStyle = colors[k];
    ctx.beginPath();
    points.forEach((p, i) => {
      const x = w - (now - p.t + 0.5) * (w / spanS), y = h - (p[key] / max) * (h - 14);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
  ctx.fillStyle = "#6b6b70";
  ctx.font = "11px system-ui";
  ctx.fillText(`max ${max.toFixed(0)} ms`, 4, 11);
}

function render(s) {
  $("running").textContent = s.num_running;
  $("waiting").textContent = s.num_waiting;
  $("prefill-tps").textContent = s.tokens_per_s.prefill.toFixed(0);
  $("decode-tps").textContent = s.tokens_per_s.decode.toFixed(1);
  $("hit-rate").textContent = s.prefix_cache ? `${(100 * s.prefix_cache.hit_rate).toFixed(1)}%` : "off";
  const last = s.history[s.history.length - 1];
  $("step-time").textContent = last && s.time - last.t < 3 ? `${last.step_time_ms.toFixed(0)} ms` : "idle";
  renderGrid(s.kv);
  const now = Math.floor(s.time);
  drawBars($("batch-chart"), s.history.map((b) => ({ t: b.t, values: [b.prefill_tokens, b.decode_tokens] })),
           ["#e08a2e", "#2f6fde"], s.history_s, now);
  drawLines($("step-chart"), s.history, ["step_time_ms", "step_time_ms_max"], ["#2f6fde", "#b0b0b8"], s.history_s, now);
  $("kernels").textContent = s.kernels ? `kernels: ${s.kernels}` : "";
  $("stats-age").textContent = `- ${s.steps} steps, ${s.preemptions} preemptions`;
}

async function refreshStats() {
  try {
    const r = await fetch("/v1/engine/stats", { headers: headers(false), cache: "no-store" });
    if (!r.ok) { $("stats-error").textContent = await errorText(r); return; }
    $("stats-error").textContent = "";
    render(await r.json());
  } catch (e) { $("stats-error").textContent = String(e); }
}

refreshHealth();
refreshModel();
refreshStats();
setInterval(refreshHealth, 3000);
setInterval(refreshStats, 500);
