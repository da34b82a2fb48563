// agentrl view: polls the run dir's API (agentrl/viewer/server.py) and draws curves and episodes. No framework.
"use strict";

const PANELS = [
  ["held-out success", [/^val\/success$/, /^val\/[^/]+\/success$/]],
  ["training success", [/^episode\/success$/]],
  ["episode return", [/^episode\/return$/]],
  ["loss", [/^train\/loss$/, /^train\/pg_loss$/]],
  ["entropy", [/^train\/entropy$/]],
  ["tokens/s", [/^throughput\/tokens_per_s$/]],
  ["idle fraction", [/^idle\/trainer$/, /^idle\/rollout$/]],
  ["staleness", [/^staleness\/mean$/, /^staleness\/max$/]],
];
const COLOURS = ["#3b6fd8", "#d8573b", "#3bab6f", "#9b3bd8", "#d89b3b", "#3bb5d8"];
const POLL_MS = 2000;

const token = new URLSearchParams(location.search).get("token");
const state = { rows: [], next: 0, steps: [], episodes: [], episode: null, turn: 0 };

async function api(path) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const res = await fetch(path, { headers });
  if (!res.ok) throw new Error(`${path}: ${res.status}`);
  return res.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

// ---- curves ------------------------------------------------------------------------------------------------
function series(patterns) {
  const names = new Set();
  for (const row of state.rows)
    for (const key of Object.keys(row))
      if (row[key] !== null && patterns.some((p) => p.test(key))) names.add(key);
  return [...names].sort().map((name) => ({
    name,
    points: state.rows.filter((r) => typeof r[name] === "number").map((r) => [r.step, r[name]]),
  }));
}

function svgNode(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function drawPanel(title, lines) {
  const W = 400, H = 190, L = 44, R = 8, T = 8, B = 22;
  const svg = svgNode("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  const all = lines.flatMap((l) => l.points);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.append(svgNode("line", { class: "grid", x1: L, x2: W - R, y1: sy(y), y2: sy(y) }));
    const label = svgNode("text", { class: "tick", x: L - 4, y: sy(y) + 3, "text-anchor": "end" });
    label.textContent = Math.abs(y) >= 1000 ? y.toExponential(1) : +y.toPrecision(3);
    svg.append(label);
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const label = svgNode("text", { class: "tick", x: sx(x), y: H - 6, "text-anchor": anchor });
    label.textContent = `step ${x}`;
    svg.append(label);
  }
  svg.append(svgNode("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  svg.append(svgNode("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  const legend = el("div", { class: "legend" });
  lines.forEach((line, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const d = line.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svg.append(svgNode("path", { d, fill: "none", stroke: colour, "stroke-width": 1.8, "data-series": line.name }));
    if (line.points.length < 40)
      for (const p of line.points) svg.append(svgNode("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: colour }));
    const last = line.points[line.points.length - 1][1];
    legend.append(el("span", {}, el("i", { style: `background:${colour}` }), `${line.name} ${+last.toPrecision(4)}`));
  });
  return el("div", { class: "panel", "data-title": title }, el("h3", {}, title), svg, legend);
}

function drawCurves() {
  const panels = document.getElementById("panels");
  panels.replaceChildren();
  for (const [title, patterns] of PANELS) {
    const lines = series(patterns);
    if (lines.length) panels.append(drawPanel(title, lines));
  }
  if (!panels.children.length) panels.append(el("p", { class: "empty" }, "no metrics yet"));
}

async function pollMetrics() {
  const got = await api(`/api/metrics?since=${state.next}`);
  state.rows.push(...got.rows);
  state.next = got.next;
  if (got.rows.length) drawCurves();
}

// ---- episodes ----------------------------------------------------------------------------------------------
function fillSelect(select, values, label = (v) => v) {
  const keep = select.value;
  select.replaceChildren(...values.map((v) => el("option", { value: v }, label(v))));
  if (values.map(String).includes(keep)) select.value = keep;
}

async function pollSteps() {
  const steps = await api("/api/steps");
  const known = JSON.stringify(state.steps);
  state.steps = steps;
  if (JSON.stringify(steps) === known) return;  // a new step, or new episodes at one (its validation)
  const select = document.getElementById("step");
  const wasLatest = !select.value || select.selectedIndex === 0;
  fillSelect(select, steps.map((s) => s.step).reverse(), (v) => `step ${v}`);
  if (wasLatest && steps.length) select.value = steps[steps.length - 1].step;
  await stepChanged();
}

async function stepChanged() {
  const step = document.getElementById("step").value;
  const info = state.steps.find((s) => String(s.step) === step);
  if (!info) return;
  fillSelect(document.getElementById("phase"), info.phases);
  fillSelect(document.getElementById("tag"), info.tags);
  await loadEpisodes();
}

async function loadEpisodes() {
  const step = document.getElementById("step").value;
  const phase = document.getElementById("phase").value;
  const tag = document.getElementById("tag").value;
  if (step === "") return;
  const query = new URLSearchParams({ phase, tag });
  state.episodes = await api(`/api/episodes/${step}?${query}`);
  const list = document.getElementById("episode-list");
  list.replaceChildren(...state.episodes.map((e, i) => el("li", { "data-episode": e.episode_id, onclick: () => openEpisode(i) },
    el("div", { class: "why" }, e.picked),
    el("div", {}, e.episode_id),
    el("div", {}, `return ${e.episode_return.toFixed(3)}${e.success === null ? "" : `, success ${e.success}`}, ${e.turns.length} turns`))));
  if (state.episodes.length) openEpisode(0);
}

const ANSI = { 30: "#000", 31: "#c0392b", 32: "#27ae60", 33: "#b7950b", 34: "#2e5cb8", 35: "#8e44ad", 36: "#16a085", 37: "#777" };

function ansiPre(text) {
  // an env's ANSI-rendered observation: SGR colour and bold codes become spans, others are dropped
  const pre = el("pre");
  let style = "";
  for (const part of text.split(/(\x1b\[[0-9;]*m)/)) {
    const m = part.match(/^\x1b\[([0-9;]*)m$/);
    if (m) {
      const codes = m[1].split(";").map(Number);
      style = codes.includes(0) || m[1] === "" ? "" : style;
      for (const c of codes) {
        const base = c >= 90 ? c - 60 : c;
        if (ANSI[base]) style += `color:${ANSI[base]};`;
        if (c === 1) style += "font-weight:bold;";
      }
    } else if (part) pre.append(style ? el("span", { style }, part) : part);
  }
  return pre;
}

function tokenColour(turn, j, mode) {
  if (mode === "advantage" && turn.advantages) {
    const a = Math.max(-1, Math.min(1, turn.advantages[j]));
    return a >= 0 ? `rgba(46, 160, 90, ${0.15 + 0.6 * a})` : `rgba(214, 69, 65, ${0.15 - 0.6 * a})`;
  }
  if (mode === "version") {
    const hue = (turn.versions[j] * 47) % 360;
    return `hsla(${hue}, 70%, 60%, 0.45)`;
  }
  return "transparent";
}

function tokensOf(turn) {
  const mode = document.getElementById("colour").value;
  const box = el("div", { class: "tokens" });
  if (!turn.tokens) return box;
  turn.tokens.forEach((text, j) => {
    const adv = turn.advantages ? `, advantage ${turn.advantages[j]}` : "";
    box.append(el("span", { class: "tok", style: `background:${tokenColour(turn, j, mode)}`,
      title: `token ${turn.token_ids[j]}, version ${turn.versions[j]}${adv}` }, text));
  });
  return box;
}

function messageNode(m, e) {
  const node = el("div", { class: `message ${m.role}` }, el("div", { class: "role" }, m.role));
  if (m.turn !== undefined) {
    const t = e.turns[m.turn];
    node.dataset.turn = m.turn;
    const parts = [`turn ${m.turn + 1}`, `reward ${t.reward}`];
    if (t.advantage !== undefined) parts.push(`advantage ${t.advantage.toFixed(3)}`);
    parts.push(`versions ${[...new Set(t.versions)].join(",")}`);
    if (t.resumes) parts.push(`resumed ${t.resumes}x after a weight update`);
    if (t.done) parts.push(e.truncation ? `ended: ${e.truncation}` : "ended the episode");
    node.append(el("div", { class: "meta" }, parts.join(" · ")));
    node.append(t.tokens ? tokensOf(t) : ansiPre(String(m.content ?? "")));
  } else {
    node.append(ansiPre(String(m.content ?? "")));
  }
  if (m.tool_calls && m.tool_calls.length) {
    const calls = el("ul", { class: "calls" });
    for (const c of m.tool_calls) {
      const fn = c.function || c;  // an OpenAI-style call (gateway agents) or a parsed one
      const text = c.error ? `malformed call: ${c.error}` : `${fn.name}(${typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments)})`;
      calls.append(el("li", {}, el("code", {}, text)));
    }
    node.append(calls);
  }
  return node;
}

function openEpisode(i) {
  const e = state.episodes[i];
  state.episode = e;
  state.turn = 0;
  for (const li of document.querySelectorAll("#episode-list li"))
    li.classList.toggle("selected", li.dataset.episode === e.episode_id);
  const success = e.success === null ? "" : ` · success ${e.success}`;
  document.getElementById("episode-head").textContent =
    `${e.episode_id} (${e.env_id}, ${e.phase} at step ${e.step}) · return ${e.episode_return.toFixed(3)} · env return ${e.env_return.toFixed(3)}${success}`;
  document.getElementById("messages").replaceChildren(...e.messages.map((m) => messageNode(m, e)));
  showTurn(0);
}

function showTurn(k) {
  const e = state.episode;
  if (!e || !e.turns.length) return;
  state.turn = Math.max(0, Math.min(e.turns.length - 1, k));
  document.getElementById("turn-pos").textContent = `turn ${state.turn + 1} of ${e.turns.length}`;
  for (const node of document.querySelectorAll("#messages .message"))
    node.classList.toggle("current", node.dataset.turn === String(state.turn));
  const current = document.querySelector("#messages .message.current");
  if (current && current.scrollIntoView) current.scrollIntoView({ block: "nearest" });
}

// ---- wiring ------------------------------------------------------------------------------------------------
async function poll() {
  try {
    await pollMetrics();
    await pollSteps();
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
  } catch (err) {
    document.getElementById("updated").textContent = `error: ${err.message}`;
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  for (const tab of document.querySelectorAll(".tab"))
    tab.addEventListener("click", () => {
      for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
      for (const v of document.querySelectorAll(".view")) v.classList.toggle("active", v.id === tab.dataset.tab);
    });
  document.getElementById("step").addEventListener("change", stepChanged);
  document.getElementById("phase").addEventListener("change", loadEpisodes);
  document.getElementById("tag").addEventListener("change", loadEpisodes);
  document.getElementById("colour").addEventListener("change", () => {
    const i = state.episodes.indexOf(state.episode);
    if (i >= 0) { const k = state.turn; openEpisode(i); showTurn(k); }
  });
  document.getElementById("prev-turn").addEventListener("click", () => showTurn(state.turn - 1));
  document.getElementById("next-turn").addEventListener("click", () => showTurn(state.turn + 1));
  const run = await api("/api/run");
  document.getElementById("run-name").textContent = run.name;
  document.title = `agentrl view: ${run.name}`;
  document.getElementById("config-text").textContent = run.config ?? "no config.yaml in the run dir";
  poll();
}

start();
