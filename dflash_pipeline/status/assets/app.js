// The status page: polls /api/status and updates the page in place (no reload).
// Every value from the run is inserted as text, never as HTML: log lines are untrusted.
"use strict";

const POLL_MS = 2000;
const token = new URLSearchParams(location.search).get("token");

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.appendChild(child);
  return node;
}

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtSeconds(s) {
  if (s == null || !isFinite(s)) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

function fmtNum(x, digits = 1) {
  return x == null ? "–" : Number(x).toLocaleString(undefined, { maximumFractionDigits: digits });
}

// A progress bar: segments of {cls, percent}; the label and aria-valuenow carry `value`.
function bar(value, segments, label) {
  const node = el("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100" });
  setBar(node, value, segments, label);
  return node;
}

function setBar(node, value, segments, label) {
  node.replaceChildren();
  for (const seg of segments) {
    const fill = el("div", { class: `fill ${seg.cls}` });
    fill.style.width = `${Math.max(0, Math.min(100, seg.percent))}%`;
    node.appendChild(fill);
  }
  node.appendChild(el("span", { class: "label", text: label }));
  node.setAttribute("aria-valuenow", value == null ? "" : String(value));
  node.dataset.value = value == null ? "" : String(value);
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
}

function td(content, cls) {
  const cell = el("td", cls ? { class: cls } : {});
  if (content instanceof Node) cell.appendChild(content); else cell.textContent = content;
  return cell;
}

function renderStages(stages) {
  fillTable("stages", stages.map((s) => {
    const pct = (n) => (s.total ? (100 * n) / s.total : 0);
    const runningShare = s.percent - pct(s.done);
    const row = el("tr", { "data-stage": s.stage }, [
      td(s.stage),
      td(bar(s.percent, [
        { cls: "done", percent: pct(s.done) },
        { cls: "running", percent: Math.max(0, runningShare) },
        { cls: "failed", percent: pct(s.failed) },
      ], `${fmtNum(s.percent, 1)}%`)),
      td(`${s.done} / ${s.total}`, "num"), td(String(s.running), "num"),
      td(String(s.failed), "num"), td(String(s.missing), "num"), td(fmtBytes(s.bytes), "num"),
    ]);
    return row;
  }));
}

function renderRunning(running) {
  const rows = [];
  for (const r of running) {
    const label = r.percent == null ? "running" : `${fmtNum(r.percent, 1)}%`;
    rows.push(el("tr", { class: "running-shard", "data-stage": r.stage, "data-shard": r.shard }, [
      td(r.stage), td(r.shard),
      td(bar(r.percent, [{ cls: "running", percent: r.percent ?? 100 }], label)),
      td(r.samples_total == null ? "–" : `${r.samples_done} / ${r.samples_total}`, "num"),
      td(fmtNum(r.tokens_per_s), "num"), td(fmtSeconds(r.eta_s), "num"), td(fmtSeconds(r.elapsed_s), "num"),
    ]));
    if (r.log_tail && r.log_tail.length) {
      const cell = el("td", { colspan: "7" }, [el("pre", { class: "log", text: r.log_tail.join("\n") })]);
      rows.push(el("tr", { class: "log-row" }, [cell]));
    }
  }
  fillTable("running", rows);
  document.getElementById("running-empty").hidden = running.length > 0;
}

function renderFailed(failed) {
  const box = document.getElementById("failed");
  box.replaceChildren(...failed.map((f) => {
    const what = f.shard ? `${f.rule} shard ${f.shard}` : f.rule;
    return el("div", { class: "failure" }, [
      el("h3", { text: `${what}${f.jobid != null ? ` (job ${f.jobid})` : ""}${f.message ? `: ${f.message}` : ""}` }),
      el("pre", { class: "log", text: (f.log_tail || []).join("\n") || "(no log yet)" }),
    ]);
  }));
  document.getElementById("failed-empty").hidden = failed.length > 0;
}

// A minimal SVG line chart of points [{x, y}]; with dots, each point is marked (a few points).
function lineChart(svgId, points, dots = false) {
  const svg = document.getElementById(svgId);
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const pts = points.filter((p) => p.y != null && isFinite(p.y));
  if (pts.length === 0) return;
  const W = 420, H = 180, L = 44, R = 10, T = 10, B = 24;
  const xs = pts.map((p) => p.x), ys = pts.map((p) => p.y);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0 || 1)) * (H - T - B);
  const add = (tag, attrs, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text != null) n.textContent = text;
    svg.appendChild(n);
  };
  add("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B });
  add("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B });
  add("polyline", { class: "line", points: pts.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ") });
  if (dots) for (const p of pts) add("circle", { class: "dot", cx: sx(p.x).toFixed(1), cy: sy(p.y).toFixed(1), r: 3 });
  add("text", { x: 2, y: T + 8 }, fmtNum(y1, 3));
  add("text", { x: 2, y: H - B }, fmtNum(y0, 3));
  add("text", { x: L, y: H - 6 }, `step ${x0}`);
  add("text", { x: W - R - 70, y: H - 6 }, `step ${x1}`);
}

function renderTraining(training, evaluation) {
  const curve = training.curve || [];
  lineChart("chart-loss", curve.map((p) => ({ x: p.step, y: p.loss })));
  // DFlash2 proposes by its selector's walk: its simulated acceptance length is the walk's.
  lineChart("chart-accept", curve.map((p) => ({ x: p.step, y: p.selector_accept_len ?? p.accept_len })));
  // Each finished segment's checkpoint in the speculative-decoding loop (rule segment_tau).
  lineChart("chart-segment-tau", (training.segment_taus || []).map((p) => ({ x: p.step, y: p.tau })), true);
  const algorithm = { dflash: "DFlash", dflash2: "DFlash2 (selector walk)" }[training.algorithm];
  document.getElementById("training-algorithm").textContent = algorithm ? `Drafter: ${algorithm}` : "";
  fillTable("segments", (training.segments || []).map((s) => el("tr", {}, [
    td(s.segment), td(s.state),
    td(s.steps_total ? `${s.steps_done ?? 0} / ${s.steps_total} (step ${s.step ?? "–"})` : String(s.step ?? "–"), "num"),
    td(fmtNum(s.tokens_per_s), "num"), td(fmtSeconds(s.eta_s), "num"),
    td(s.tau == null ? "–" : fmtNum(s.tau, 2), "num segment-tau"),
  ])));
  document.getElementById("training-empty").hidden = curve.length > 0 || (training.segments || []).length > 0;
  const box = document.getElementById("evaluation");
  box.replaceChildren();
  if (evaluation) {
    const sets = Object.entries(evaluation.prompt_sets || {}).map(([k, v]) => `${k}: ${fmtNum(v, 2)}`).join(", ");
    const drafter = { dflash: "DFlash", dflash2: "DFlash2" }[evaluation.algorithm];
    box.appendChild(el("p", { text: `Evaluation${drafter ? ` (${drafter})` : ""}: acceptance length τ = ${fmtNum(evaluation.tau, 2)}` +
      (evaluation.speedup_estimate != null ? `, estimated speed-up ${fmtNum(evaluation.speedup_estimate, 2)}×` : "") +
      (sets ? ` (${sets})` : "") + (evaluation.old ? " (old: from before the rerun)" : "") }));
    const engine = evaluation.engine;
    if (engine) {
      const engineSets = Object.entries(engine.prompt_sets || {}).map(([k, v]) => `${k}: ${fmtNum(v, 2)}`).join(", ");
      const parity = engine.parity;
      box.appendChild(el("p", { text: `Served by ${engine.name} ${engine.version ?? ""}: τ = ${fmtNum(engine.tau, 2)}` +
        (engineSets ? ` (${engineSets})` : "") +
        (engine.lossless != null ? `, lossless ${engine.lossless ? "yes" : "NO"}` : "") +
        (parity ? `; gap to the loop ${fmtNum(100 * parity.gap, 1)}% (tolerance ${fmtNum(100 * parity.tolerance, 1)}%, ${parity.passed ? "passed" : "FAILED"})` : "") }));
    }
  }
}

function renderStorage(storage, throughput) {
  // null: no such job runs now ("–"), not a rate of 0.
  document.getElementById("tokens-per-s").textContent = fmtNum(throughput.tokens_per_s);
  document.getElementById("training-tokens-per-s").textContent = fmtNum(throughput.training_tokens_per_s);
  document.getElementById("tokens-generated").textContent = fmtNum(throughput.tokens_generated, 0);
  const rows = Object.entries(storage.by_category || {}).map(([name, use]) => el("tr", {}, [
    td(name), td(String(use.objects), "num"), td(fmtBytes(use.bytes), "num"),
  ]));
  rows.push(el("tr", {}, [td("total"), td(""), td(fmtBytes(storage.total_bytes), "num")]));
  fillTable("storage", rows);
}

function renderHeadline(headline) {
  // Rows come formatted (report/headline.py), the same as the report's; null is not measured yet.
  const box = document.getElementById("headline");
  box.replaceChildren(...((headline && headline.rows) || []).map((row) =>
    el("div", { "data-key": row.key }, [el("dt", { text: row.label }), el("dd", { text: row.text ?? "—" })])));
}

function renderTune(tune) {
  const box = document.getElementById("tune");
  box.hidden = !tune;
  box.textContent = tune
    ? `Engine settings measured by tune: concurrency ${tune.concurrency}${tune.mtp ? " with MTP" : ""}, ` +
      `${fmtNum(tune.tokens_per_s_per_gpu)} tokens/s per GPU (${tune.why}; ${tune.settings} settings, ` +
      `${tune.engine} on ${tune.device}, ${tune.measured_at_utc})`
    : "";
}

function render(status) {
  const error = document.getElementById("error");
  error.hidden = !status.error;
  error.textContent = status.error || "";
  if (status.error) return;
  document.getElementById("run-name").textContent = status.run;
  const halt = document.getElementById("halt");
  halt.hidden = !status.halt;
  halt.textContent = status.halt
    ? `The run is halted since ${status.halt.halted_at_utc || "?"}: ${status.halt.stage} ` +
      `${status.halt.unit || "shard"} ${status.halt.shard} ${status.halt.cause}. Fix the cause, then clear it ` +
      `(make clear-halt): ` +
      `python -m dflash_pipeline.stages.tokenize clear-halt --run-url ${status.run}`
    : "";
  const lease = document.getElementById("lease");
  lease.hidden = !status.lease;
  lease.textContent = status.lease
    ? (status.lease.expired ? "Driver lease expired (the next driver takes it over): " : "Driven by ") +
      status.lease.holder
    : "";
  const wf = status.workflow;
  document.getElementById("workflow-state").textContent = wf.state;
  document.getElementById("workflow-steps").textContent = wf.steps_total ? `${wf.steps_done} / ${wf.steps_total}` : "–";
  document.getElementById("updated-at").textContent = new Date(status.generated_at * 1000).toLocaleTimeString();
  setBar(document.getElementById("overall-progress"), status.progress_percent,
    [{ cls: "done", percent: status.progress_percent }], `${fmtNum(status.progress_percent, 1)}% of all stages`);
  renderStages(status.stages);
  renderRunning(status.running);
  renderFailed(status.failed);
  renderTraining(status.training, status.evaluation);
  renderStorage(status.storage, status.throughput);
  renderTune(status.tune);
  renderHeadline(status.headline);
}

async function poll() {
  try {
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const response = await fetch("/api/status", { headers, cache: "no-store" });
    if (!response.ok) throw new Error(`status ${response.status}`);
    render(await response.json());
  } catch (err) {
    const error = document.getElementById("error");
    error.hidden = false;
    error.textContent = `The status server does not answer (${err.message}); retrying.`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
