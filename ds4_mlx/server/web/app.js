// The ds4-mlx page: a chat over the server's OpenAI endpoint and a live view of its session slots.
// Model text only ever reaches the page as text nodes (textContent), never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const CHART_REQUESTS = 40;

const chat = { messages: [], controller: null };

// ---------------------------------------------------------------- the API key

// A server started with --api-key answers 401 without it: the page asks once and keeps the key for this
// tab only (sessionStorage), never in the page's code or URL. A dismissed question is not asked again by
// the background polling; the next message sent asks again.
const KEY_ITEM = "ds4-mlx-api-key";
const keyState = { declined: false };

async function apiFetch(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = { ...(options.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401 || attempt > 0 || keyState.declined) return response;
    const entered = window.prompt(key ? "The API key was not accepted; enter it again:"
                                      : "This server needs its API key (serve --api-key):");
    if (!entered || !entered.trim()) {
      keyState.declined = true;
      return response;
    }
    sessionStorage.setItem(KEY_ITEM, entered.trim());
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---------------------------------------------------------------- Markdown, as DOM nodes

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w.+#-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const isBlockStart = (line) => FENCE.test(line) || HEADING.test(line) || BULLET.test(line) ||
  NUMBERED.test(line) || QUOTE.test(line);

function renderMarkdown(container, text) {
  const lines = text.split("\n");
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      i++; // the closing fence (absent while the block is still streaming)
      const pre = el("pre");
      const code = el("code", fence[2] ? `language-${fence[2]}` : "", body.join("\n"));
      pre.append(code);
      blocks.push(pre);
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      blocks.push(inline(el(`h${Math.min(6, heading[1].length + 2)}`), heading[2]));
      i++;
      continue;
    }
    const list = line.match(BULLET) ? ["ul", BULLET] : line.match(NUMBERED) ? ["ol", NUMBERED] : null;
    if (list) {
      const node = el(list[0]);
      for (; i < lines.length && list[1].test(lines[i]); i++) node.append(inline(el("li"), lines[i].match(list[1])[1]));
      blocks.push(node);
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].match(QUOTE)[1]);
      blocks.push(inline(el("blockquote"), quoted.join("\n")));
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !isBlockStart(lines[i]); i++) paragraph.push(lines[i]);
    blocks.push(inline(el("p"), paragraph.join("\n")));
  }
  container.replaceChildren(...blocks);
}

// `code`, **bold**, *italic*, [text](http(s) link); everything else is text
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(text.slice(last, match.index));
    const [, ticks, code, bold, italic, label, url] = match;
    if (ticks) parent.append(el("code", "", code));
    else if (bold !== undefined) parent.append(inline(el("strong"), bold));
    else if (italic !== undefined) parent.append(inline(el("em"), italic));
    else {
      const link = el("a", "", label);
      link.href = url; // only http(s) reaches here
      link.rel = "noopener noreferrer";
      link.target = "_blank";
      parent.append(link);
    }
    last = match.index + match[0].length;
  }
  parent.append(text.slice(last));
  return parent;
}

// ---------------------------------------------------------------- chat

function addTurn(role) {
  const node = el("div", `turn ${role}`);
  $("messages").append(node);
  return node;
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// a reader who scrolled up to read is left there while the answer grows
function atEnd() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 60;
}

class AnswerView {
  constructor() {
    this.node = addTurn("assistant");
    this.node.dataset.state = "streaming";
    this.thinking = el("details", "thinking");
    this.summary = el("summary", "", "Thinking…");
    this.reasoningNode = el("div", "reasoning");
    this.thinking.append(this.summary, this.reasoningNode);
    this.thinking.hidden = true;
    this.contentNode = el("div", "content");
    this.figuresNode = el("div", "figures", "waiting for the model…");
    this.node.append(this.thinking, this.contentNode, this.figuresNode);
    this.reasoning = "";
    this.content = "";
    this.pending = false;
  }

  add(delta) {
    if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
    if (delta.content) this.content += delta.content;
    if (!this.pending) { // one render per 30 ms, however fast tokens come
      this.pending = true;
      setTimeout(() => { this.pending = false; this.render(); }, 30);
    }
  }

  render() {
    const follow = atEnd();
    if (this.reasoning) {
      this.thinking.hidden = false;
      this.reasoningNode.textContent = this.reasoning;
    }
    renderMarkdown(this.contentNode, this.content);
    if (this.node.dataset.state === "streaming") this.figuresNode.textContent = "answering…";
    if (follow) scrollToEnd();
  }

  finish(state, figures) {
    this.node.dataset.state = state;
    this.summary.textContent = "Thinking";
    this.render();
    this.figuresNode.textContent = figures;
  }
}

function costLine(usage, finishReason) {
  const f = usage && usage.ds4_mlx;
  if (!f) return `finished: ${finishReason || "?"}`;
  return `prompt ${usage.prompt_tokens} tokens: ${f.reused_tokens} reused, ${f.replayed_tokens} replayed, ` +
    `${f.computed_tokens} computed · prefill ${f.prefill_tokens_per_second} tok/s · ` +
    `${usage.completion_tokens} generated at ${f.decode_tokens_per_second} tok/s · ${finishReason}`;
}

// server-sent events: yields the data of each event (comments such as keepalives are skipped)
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, cut).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      buffer = buffer.slice(cut + 2);
      if (data) yield data;
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function send(text) {
  const conversation = chat.messages;
  chat.messages.push({ role: "user", content: text });
  addTurn("user").textContent = text;
  const answer = new AnswerView();
  scrollToEnd();
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  let usage = null, finishReason = null;
  const request = { messages: chat.messages, stream: true, stream_options: { include_usage: true },
                    thinking: $("thinking").checked };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) request.max_tokens = maxTokens;
  try {
    keyState.declined = false; // sending is the user's own act: a key may be asked for again
    const response = await apiFetch("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal: controller.signal,
      body: JSON.stringify(request),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      const choice = event.choices && event.choices[0];
      if (choice && choice.delta) answer.add(choice.delta);
      if (choice && choice.finish_reason) finishReason = choice.finish_reason;
      if (event.usage) usage = event.usage;
    }
    answer.finish("done", costLine(usage, finishReason));
  } catch (error) {
    if (error.name === "AbortError") {
      answer.finish("stopped", "stopped: the server keeps what it computed, so the next message reuses it " +
                               "(its figures are in the sessions table)");
    } else {
      answer.node.classList.add("error");
      answer.finish("error", `error: ${error.message}`);
    }
  } finally {
    if (chat.controller === controller) chat.controller = null;
    setBusy(chat.controller !== null);
    refreshSessions();
  }
  if (conversation !== chat.messages) return; // a new chat began meanwhile
  if (answer.content || answer.reasoning) {
    // the answer, even a stopped one, stays in the conversation: the next prompt extends the cached tokens
    chat.messages.push({ role: "assistant", content: answer.content, reasoning_content: answer.reasoning });
  } else if (answer.node.dataset.state === "error") {
    chat.messages.pop(); // nothing came back: the failed message is not part of the conversation
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function newChat() {
  if (chat.controller) chat.controller.abort();
  chat.controller = null;
  chat.messages = [];
  $("messages").replaceChildren();
  setBusy(false);
  $("prompt").focus();
}

// ---------------------------------------------------------------- sessions

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let i = -1;
  do { n /= 1024; i++; } while (n >= 1024 && i < units.length - 1);
  return `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
}

function formatAgo(seconds) {
  if (seconds === null) return "never";
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function renderSlots(slots) {
  const rows = slots.map((slot) => {
    const last = slot.last_request;
    const theirs = slot.tokens === null; // another tenant's slot: the server says only whether it is busy
    const cells = {
      slot: slot.slot, state: slot.busy ? "busy" : "idle", tokens: theirs ? "another tenant's" : slot.tokens,
      bytes: theirs ? "" : formatBytes(slot.bytes), "last-use": slot.busy ? "now" : formatAgo(slot.idle_seconds),
      reused: last ? last.reused_tokens : "", replayed: last ? last.replayed_tokens : "",
      computed: last ? last.computed_tokens : "",
      prefill: last ? last.prefill_tokens_per_second : "", decode: last ? last.decode_tokens_per_second : "",
    };
    const row = el("tr");
    row.dataset.slot = slot.slot;
    for (const [field, value] of Object.entries(cells)) {
      const cell = el("td", "", String(value));
      cell.dataset.field = field;
      row.append(cell);
    }
    if (last && last.miss) row.title = `last request: ${last.finish_reason}, cache miss: ${last.miss}`;
    return row;
  });
  document.querySelector("#slots tbody").replaceChildren(...rows);
}

function svg(tag, attributes, title) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (title) {
    const tooltip = document.createElementNS(SVG, "title");
    tooltip.textContent = title;
    node.append(tooltip);
  }
  return node;
}

// stacked bars, one per request, oldest on the left: reused, replayed and computed prompt tokens
function renderChart(requests) {
  const shown = requests.slice(-CHART_REQUESTS);
  const width = 400, height = 160, left = 44, bottom = 18, top = 8;
  const plot = height - bottom - top;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img",
                             "aria-label": "prompt tokens per request: reused, replayed, computed" });
  const peak = Math.max(1, ...shown.map((r) => r.reused_tokens + r.replayed_tokens + r.computed_tokens));
  chart.append(svg("line", { class: "axis", x1: left, y1: top + plot, x2: width, y2: top + plot }),
               svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: top + plot }));
  const yLabel = (value, y) => {
    const label = svg("text", { x: left - 4, y, "text-anchor": "end", "dominant-baseline": "middle" });
    label.textContent = String(value);
    return label;
  };
  chart.append(yLabel(peak, top + 4), yLabel(0, top + plot));
  const caption = svg("text", { x: left, y: height - 4 });
  caption.textContent = shown.length ? `last ${shown.length} request(s), oldest first` : "no requests yet";
  chart.append(caption);
  const step = (width - left - 4) / CHART_REQUESTS;
  shown.forEach((request, i) => {
    let y = top + plot;
    const time = new Date(request.finished_at * 1000).toLocaleTimeString();
    for (const part of ["reused", "replayed", "computed"]) {
      const tokens = request[`${part}_tokens`];
      const h = (tokens / peak) * plot;
      y -= h;
      chart.append(svg("rect", { class: part, x: left + 2 + i * step, y, width: Math.max(1, step - 2), height: h },
                       `${time}, slot ${request.slot}: ${tokens} ${part} of ${request.prompt_tokens} prompt tokens`));
    }
  });
  $("chart").replaceChildren(chart);
}

async function refreshSessions() {
  try {
    const response = await apiFetch("v1/sessions", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snapshot = await response.json();
    $("model").textContent = `${snapshot.model}, ${snapshot.context_length}-token context`;
    $("server-status").textContent = snapshot.queued ? `${snapshot.queued} queued` : "";
    renderSlots(snapshot.slots);
    renderChart(snapshot.requests);
  } catch (error) {
    $("server-status").textContent = `server unreachable (${error.message})`;
  }
}

async function pollSessions() {
  await refreshSessions();
  setTimeout(pollSessions, POLL_MS);
}

// ---------------------------------------------------------------- wiring

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || chat.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  const stop = () => chat.controller && chat.controller.abort();
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });
  $("new-chat").addEventListener("click", newChat);
  pollSessions();
});
