// The status page: polls GET /v1/status once a second (the page's cookie carries the token) and draws its
// "live" part. Reads only: nothing here changes the run. Phase colours are those of `nodeox report --plot`.
"use strict";

const PHASE_COLOURS = {
  train: "#9ecae1", encode: "#e6550d", upload: "#fd8d3c", wait: "#bdbdbd", poll: "#dadaeb",
  download: "#31a354", apply: "#74c476", verify: "#a1d99b", fold: "#006d2c", provide_model: "#fdd0a2",
  fallback_fetch: "#de2d26",
  receive: "#756bb1", aggregate: "#9e9ac8", sync_prepare: "#3182bd", model_materialize: "#636363",
  persist: "#8c6d31", store: "#e7ba52",
};
const OTHER = "#000000";
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
let firstRound = null;

function $(id) { return document.getElementById(id); }

function bytes(n) {
  if (n === null || n === undefined) return "-";
  for (const unit of ["B", "kB", "MB", "GB"]) {
    if (Math.abs(n) < 1000 || unit === "GB") return unit === "B" ? `${n.toFixed(0)} B` : `${n.toFixed(1)} ${unit}`;
    n /= 1000;
  }
}

function seconds(s) { return s === null || s === undefined ? "-" : `${s.toFixed(1)} s`; }
function share(x) { return x === null || x === undefined ? "-" : `${Math.round(100 * x)}%`; }
function money(x) { return Math.abs(x) < 1 ? x.toFixed(4) : x.toFixed(2); }
function number(x) { return x === null || x === undefined ? "-" : Number(x).toPrecision(4); }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function drawHosts(live) {
  const body = $("hosts").tBodies[0];
  body.replaceChildren();
  const priced = live.gpu_hour_price !== null && live.gpu_hour_price !== undefined;
  for (const el of document.querySelectorAll("th.cost")) el.hidden = !priced;
  for (const h of live.hosts) {
    const row = body.insertRow();
    row.className = `host ${h.state.replace(/ /g, "-")}`;
    row.dataset.host = h.id;
    cell(row, h.id, "text id");
    cell(row, h.state, "text host-state");
    cell(row, seconds(h.lease_age_s));
    cell(row, h.last_round === null ? "-" : String(h.last_round), "last-round");
    cell(row, share(h.wait_share));
    cell(row, bytes(h.bytes_per_round));
    cell(row, number(h.loss));
    cell(row, Object.entries(h.metrics || {}).map(([k, v]) => `${k} ${number(v)}`).join(", ") || "-", "text");
    if (priced) cell(row, money(h.wait_cost));
  }
}

function drawData(data) { // GET /v1/status's "data" (the data ledger), absent until a host declared its data
  $("data").hidden = !data;
  if (!data) return;
  $("data-epoch").textContent = String(data.epoch);
  $("data-committed").textContent = String(data.epoch_committed_samples);
  $("data-samples").textContent = String(data.samples);
  $("data-fraction").textContent = share(data.epoch_committed_fraction);
  $("data-progress").value = data.epoch_committed_fraction;
  $("data-unit").textContent = String(data.unit_size);
  $("data-units-committed").textContent = String(data.units_committed);
  $("data-units-held").textContent = String(data.units_held);
  $("data-units-free").textContent = String(data.units_free);
  $("data-units").textContent = String(data.units);
  const body = $("data-hosts").tBodies[0];
  body.replaceChildren();
  for (const [name, h] of Object.entries(data.hosts)) {
    const row = body.insertRow();
    row.className = h.present ? "host" : "host gone";
    row.dataset.host = name;
    cell(row, h.present ? name : `${name} (gone)`, "text id");
    for (const key of ["leased", "committed", "in_flight", "returned", "units_held"]) cell(row, String(h[key]), key);
  }
}

function drawMerge(merge) { // GET /v1/status's "merge", under --merge async only
  $("merge").hidden = !merge;
  if (!merge) return;
  $("merge-quorum").textContent = String(merge.min_quorum);
  $("merge-grace").textContent = merge.grace_s.toFixed(2);
  $("merge-max").textContent = String(merge.max_staleness);
  $("merge-rule").textContent = merge.staleness_rule;
  $("merge-late-deltas").textContent = String(merge.late_deltas);
  const last = merge.last || {};
  $("merge-round").textContent = last.round === undefined ? "-" : String(last.round);
  $("merge-late").textContent = (last.late || []).join(", ") || "no host";
  $("merge-stale").textContent = Object.entries(last.stale || {}).map(([h, s]) => `${h} (${s} round${s === 1 ? "" : "s"} late)`)
    .join(", ") || "none";
}

function drawTimeline(timeline) {
  const lanes = timeline.lanes; // [[lane, [[phase, start, end, round], ...]], ...], the coordinator's first
  const bars = lanes.flatMap(([, phases]) => phases);
  const box = $("timeline");
  box.replaceChildren();
  if (!bars.length) { box.textContent = "no rounds yet"; return; }
  const t0 = Math.min(...bars.map((b) => b[1]));
  const t1 = Math.max(...bars.map((b) => b[2]));
  const left = 110, right = 40, width = Math.max(400, box.clientWidth || 900) - left - right, lane = 22;
  const x = (t) => left + (width * (t - t0)) / Math.max(t1 - t0, 1e-6);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", left + width + right);
  svg.setAttribute("height", lane * lanes.length + 34);
  const present = new Set();
  lanes.forEach(([name, phases], i) => {
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", 0);
    label.setAttribute("y", i * lane + 15);
    label.textContent = name === "coordinator" ? name : `host ${name}`;
    svg.appendChild(label);
    for (const [phase, start, end, round] of phases) {
      present.add(phase);
      const rect = document.createElementNS(SVG, "rect");
      const thin = phase === "receive";
      rect.setAttribute("x", x(start));
      rect.setAttribute("y", i * lane + (thin ? 10 : 3));
      rect.setAttribute("width", Math.max(x(end) - x(start), 1));
      rect.setAttribute("height", thin ? 8 : lane - 6);
      rect.setAttribute("fill", PHASE_COLOURS[phase] || OTHER);
      rect.setAttribute("class", "bar");
      rect.dataset.phase = phase;
      rect.dataset.lane = name;
      rect.dataset.round = round;
      const title = document.createElementNS(SVG, "title");
      title.textContent = `${name}: ${phase}, round ${round}, ${(end - start).toFixed(3)} s`;
      rect.appendChild(title);
      svg.appendChild(rect);
    }
  });
  for (const [phase, , end, round] of lanes[0][1]) { // each round's sync published (the coordinator's lane)
    if (phase !== "sync_prepare") continue;
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", x(end));
    line.setAttribute("x2", x(end));
    line.setAttribute("y1", 0);
    line.setAttribute("y2", lane * lanes.length);
    line.setAttribute("stroke", "#000");
    line.setAttribute("stroke-dasharray", "2,2");
    svg.appendChild(line);
    const mark = document.createElementNS(SVG, "text");
    mark.setAttribute("x", x(end) + 2);
    mark.setAttribute("y", lane * lanes.length + 8);
    mark.textContent = `r${round}`;
    svg.appendChild(mark);
  }
  const axis = document.createElementNS(SVG, "text");
  axis.setAttribute("x", left);
  axis.setAttribute("y", lane * lanes.length + 28);
  axis.textContent = `rounds ${timeline.rounds[0]}–${timeline.rounds[timeline.rounds.length - 1]}: ` +
    `${(t1 - t0).toFixed(1)} s (coordinator clock); dashed: sync published`;
  svg.appendChild(axis);
  box.appendChild(svg);
  const legend = $("legend");
  legend.replaceChildren();
  for (const phase of Object.keys(PHASE_COLOURS).filter((p) => present.has(p))) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = PHASE_COLOURS[phase];
    item.append(swatch, phase);
    legend.appendChild(item);
  }
}

function draw(status) {
  const live = status.live;
  document.title = `${live.name}: round ${live.round}`;
  $("name").textContent = live.name;
  const state = $("state");
  state.textContent = live.state;
  state.className = "state" + (live.state === "complete" ? " done" : live.state === "running" ? "" : " bad");
  $("round").textContent = String(live.round);
  $("published").textContent = live.published_round < 0 ? "-" : String(live.published_round);
  $("hash").textContent = live.model_hash || "-";
  $("rss").textContent = bytes(live.coordinator.rss_bytes);
  $("peak").textContent = bytes(live.coordinator.peak_rss_bytes);
  $("link").textContent = live.link_bytes_per_s === null ? "-" : `${bytes(live.link_bytes_per_s)}/s`;
  const priced = live.gpu_hour_price !== null && live.gpu_hour_price !== undefined;
  $("cost-box").hidden = !priced;
  if (priced) {
    $("cost").textContent = money(live.wait_cost);
    $("price").textContent = String(live.gpu_hour_price);
  }
  $("updated").textContent = new Date(live.now * 1000).toLocaleTimeString();
  if (firstRound === null) {
    firstRound = live.round;
    $("first-round").textContent = String(firstRound);
  }
  drawHosts(live);
  drawData(status.data);
  drawMerge(status.merge);
  drawTimeline(live.timeline);
}

async function poll() {
  try {
    const response = await fetch("/v1/status", { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401) {
      $("state").textContent = "refused: open the link the coordinator printed (it carries the token)";
      $("state").className = "state bad";
      return; // no retries without a token
    }
    draw(await response.json());
  } catch (e) {
    $("state").textContent = `unreachable (${e.message || e})`;
    $("state").className = "state bad";
  }
  setTimeout(poll, POLL_MS);
}

poll();
