// #/jobs/<value>?stuck_after=600 : one job (the sandboxes carrying one value of the node's job label):
// its figures now and over the last hour (GET /v1/jobs/{value}: counted by the node as things happen,
// the page gets no list of sandboxes), the sandboxes worth a look (stuck, slowest) to act on, and its
// trajectories (GET /v1/trajectories?label=...). The whole job is acted on by label (one call); a
// selection sandbox by sandbox.

import { api, sandboxPath } from "../api.js";
import { LineChart } from "../charts.js";
import { causeBadge, cut, jobHash, quotaTable, sandboxHash, trajectoryHash, verdictBadge } from "../figures.js";
import { loadUplot } from "../libs.js";
import {
  actionButton,
  agoCell,
  card,
  countChips,
  facts,
  fill,
  fmtBytes,
  fmtCores,
  fmtNumber,
  fmtSeconds,
  fmtShare,
  fmtTime,
  h,
  labelChips,
  meter,
  note,
  notify,
  pageHead,
  setEnabled,
  showError,
  stateBadge,
  table,
  timeCell,
} from "../ui.js";
import { sandboxesHash } from "./sandboxes.js";

const POLL_MS = 5000;
const TRAJECTORIES_MS = 15000; // the job's newest trajectories: asked for less often
const TRAJECTORIES_SHOWN = 200;
const STUCK_AFTER = 600; // seconds without a request before a running sandbox is listed as stuck
const PARALLEL = 8; // calls in flight at once when acting on a selection
const STATES = ["creating", "running", "paused", "stopping", "stopped", "failed"];
const CAUSES = ["infra", "agent", "timeout", "verifier", "caller"];
const STATE_COLORS = ["#f2cf72", "#4cc38a", "#a88bfa", "#e3a35e", "#8b96a5", "#f0706a"];
const CAUSE_COLORS = ["#f0706a", "#e3b341", "#a88bfa", "#5aa9ff", "#8b96a5"];

export async function jobPage(root, ctx) {
  const value = ctx.params[0];
  const stuckAfter = Number(ctx.query.get("stuck_after")) > 0 ? Number(ctx.query.get("stuck_after")) : STUCK_AFTER;
  const view = new JobView(root, ctx, value, stuckAfter);
  ctx.onCleanup(() => view.dispose());
  await Promise.all([ctx.every(POLL_MS, () => view.poll()), ctx.every(TRAJECTORIES_MS, () => view.pollTrajectories())]);
}

class JobView {
  constructor(root, ctx, value, stuckAfter) {
    this.ctx = ctx;
    this.value = value;
    this.stuckAfter = stuckAfter;
    this.uplot = null; // loading uPlot: once the first answer is painted (a cold load paints its figures first)
    this.key = null; // the node's job label, from the first answer
    this.keyKnown = new Promise((resolve) => (this.setKey = resolve));
    this.shown = null; // the answer drawn (its JSON): the same again is not drawn again
    this.shownTrajectories = null;
    this.selected = new Set(); // ids of the stuck and slowest sandboxes picked
    this.charts = null;

    const el = (id) => h("div", { id });
    this.summary = h("span", { class: "muted", id: "job-summary" });
    const p = (this.parts = {
      now: el("job-now"),
      resources: el("job-resources"),
      verifications: el("job-verifications"),
      rewards: el("job-rewards"),
      failures: el("job-failures"),
      findings: el("job-findings"),
      stuck: el("job-stuck"),
      slowest: el("job-slowest"),
      trajectories: el("job-trajectories"),
    });
    const chart = (id) => h("div", { class: "chart chart-small", id });
    this.chartHosts = { states: chart("chart-states"), lifecycle: chart("chart-lifecycle"), work: chart("chart-work"), failures: chart("chart-failures") };
    this.chartNote = note("", "chart-note");
    const chartCell = (title, host) => h("div", { class: "chart-cell" }, h("h3", {}, title), host);
    const charts = h(
      "div",
      { class: "chart-grid" },
      chartCell("sandboxes by state", this.chartHosts.states),
      chartCell("creates and stops per second", this.chartHosts.lifecycle),
      chartCell("steps and commands per second", this.chartHosts.work),
      chartCell("failures per minute, by cause", this.chartHosts.failures),
    );
    this.tools = h("div", { id: "job-tools" }); // the actions: once it is known who we are (the first answer)
    root.append(
      h("a", { href: "#/jobs", class: "back" }, "‹ Jobs"),
      pageHead(h("span", { id: "job-title" }, value), this.summary, this.stuckForm()),
      this.tools,
      h(
        "div",
        { class: "stack" },
        h(
          "div",
          { class: "grid grid-job" },
          card("Sandboxes", {}, p.now),
          card("CPU and memory", {}, p.resources),
          card("Verifications", {}, p.verifications),
          card("Rewards", {}, p.rewards),
        ),
        card("Over time", { wide: true, id: "job-charts" }, this.chartNote, charts),
        h("div", { class: "grid grid-2" }, card("Failures", {}, p.failures), card("Detector findings", {}, p.findings)),
        card("Stuck", { wide: true, tools: [h("span", { class: "muted" }, this.stuckWhy())] }, p.stuck),
        card("Running longest", { wide: true }, p.slowest),
        card("Trajectories", { wide: true }, p.trajectories),
      ),
    );
  }

  stuckWhy() {
    return `running without a request for ${fmtSeconds(this.stuckAfter)}, an agent not answering, or detector findings`;
  }

  stuckForm() {
    const input = h("input", { id: "stuck-after", type: "number", min: "1", step: "1", value: String(this.stuckAfter), title: "seconds without a request" });
    const form = h("form", { class: "inline-form" }, h("label", {}, "stuck after ", input, " s"), h("button", { type: "submit" }, "Apply"));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const s = Number(input.value);
      location.hash = jobHash(this.value, s > 0 && s !== STUCK_AFTER ? { stuck_after: String(s) } : {});
    });
    return form;
  }

  // -- actions ---------------------------------------------------------------------------------------

  toolbar() {
    const ctx = this.ctx;
    this.idleTtl = h("input", { id: "lifetime-idle", type: "number", min: "1", value: "3600", title: "idle TTL: seconds without a request before it is stopped (counted from now)" });
    this.maxLifetime = h("input", { id: "lifetime-max", type: "number", min: "1", placeholder: "as is", title: "max lifetime: seconds after its creation (empty: left as it is)" });
    const whole = (verb) => () => this.actOnJob(verb);
    this.selCount = h("span", { id: "sel-count", class: "muted" });
    const sel = (verb) => () => this.actOnSelection(verb);
    this.selButtons = [
      actionButton(ctx, "Pause", sel("pause"), { id: "sel-pause" }),
      actionButton(ctx, "Resume", sel("resume"), { id: "sel-resume" }),
      actionButton(ctx, "Stop", sel("stop"), { id: "sel-stop", danger: true, confirm: "Stop them?" }),
      actionButton(ctx, "Extend lifetime", sel("lifetime"), { id: "sel-extend" }),
    ];
    return h(
      "div",
      { class: "toolbar", id: "job-actions" },
      h(
        "span",
        { class: "tool-group" },
        h("span", { class: "muted" }, "whole job"),
        actionButton(ctx, "Pause", whole("pause"), { id: "job-pause", title: "pause every running sandbox of the job" }),
        actionButton(ctx, "Resume", whole("resume"), { id: "job-resume" }),
        actionButton(ctx, "Stop", whole("stop"), { id: "job-stop", danger: true, confirm: "Stop the job?", title: "stop every sandbox of the job" }),
        actionButton(ctx, "Extend lifetime", whole("lifetime"), { id: "job-extend" }),
      ),
      h("span", { class: "tool-group" }, this.selCount, this.selButtons),
      h("span", { class: "tool-group" }, h("label", {}, "idle TTL ", this.idleTtl, " s"), h("label", {}, "max lifetime ", this.maxLifetime, " s")),
    );
  }

  /** The lifetimes the inputs say (LifetimeUpdate): a field left empty is left as it is. */
  lifetime() {
    const out = {};
    for (const [field, input] of [["idle_ttl", this.idleTtl], ["max_lifetime", this.maxLifetime]]) {
      if (input.value.trim() === "") continue;
      const n = Number(input.value);
      if (!(n > 0)) throw new Error(`${field}: a number of seconds above 0`);
      out[field] = n;
    }
    if (!Object.keys(out).length) throw new Error("give an idle TTL or a max lifetime (seconds)");
    return out;
  }

  async actOnJob(verb) {
    const labels = { [this.key]: this.value };
    const res =
      verb === "lifetime"
        ? await api("/v1/sandboxes/lifetimes", { method: "POST", body: { labels, ...this.lifetime() } })
        : await api(`/v1/sandboxes/${verb}`, { method: "POST", body: { labels } });
    const ids = res.stopped || res.sandboxes || [];
    const what = verb === "lifetime" ? "new lifetime" : verb;
    notify(`${what}: ${ids.length} sandbox${ids.length === 1 ? "" : "es"} of ${this.key}=${this.value}`);
    await this.poll();
  }

  async actOnSelection(verb) {
    const ids = [...this.selected];
    const body = verb === "lifetime" ? this.lifetime() : undefined;
    const call = {
      pause: (id) => api(sandboxPath(id, "/pause"), { method: "POST" }),
      resume: (id) => api(sandboxPath(id, "/resume"), { method: "POST" }),
      stop: (id) => api(sandboxPath(id), { method: "DELETE" }),
      lifetime: (id) => api(sandboxPath(id), { method: "PATCH", body }),
    }[verb];
    const failed = [];
    const queue = [...ids];
    const worker = async () => {
      for (let id = queue.shift(); id !== undefined; id = queue.shift()) {
        try {
          await call(id);
        } catch (err) {
          failed.push([id, err]);
        }
      }
    };
    await Promise.all(Array.from({ length: Math.min(PARALLEL, ids.length) }, worker));
    const what = verb === "lifetime" ? "new lifetime" : verb;
    notify(`${what}: ${ids.length - failed.length} of ${ids.length} selected sandbox${ids.length === 1 ? "" : "es"}`);
    if (failed.length) {
      const [id, err] = failed[0];
      const more = failed.length > 1 ? ` (and ${failed.length - 1} more)` : "";
      showError({ code: err.code, message: `${id}: ${err.message}${more}` });
    }
    await this.poll();
  }

  showSelection() {
    if (!this.selCount) return; // no toolbar yet
    const n = this.selected.size;
    this.selCount.textContent = n ? `${n} selected` : "none selected";
    this.selButtons.forEach((b) => setEnabled(b, n > 0));
  }

  // -- the answer ------------------------------------------------------------------------------------

  async poll() {
    const asked = (this.asked = (this.asked || 0) + 1); // an action's poll may overtake the timer's
    const stats = await api(`/v1/jobs/${encodeURIComponent(this.value)}`, { query: { stuck_after: this.stuckAfter } });
    if (!this.ctx.alive || asked !== this.asked) return;
    if (!this.key) {
      this.key = stats.key;
      this.setKey(stats.key);
      this.tools.replaceWith(this.toolbar());
    }
    const text = JSON.stringify(stats);
    if (text === this.shown) return;
    this.shown = text;
    this.draw(stats);
    await this.drawCharts(stats);
  }

  draw(s) {
    const live = ["creating", "running", "paused", "stopping"].reduce((n, k) => n + (s.states[k] || 0), 0);
    this.summary.textContent = `${s.key}=${s.value} · ${live} live · counted since ${fmtTime(s.since)}`;
    const p = this.parts;
    fill(p.now, stateCounts(s.states), facts([
      ["created", String(s.created)],
      ["creates refused", refused(s.refused || {})],
      ["stopped", String(s.stopped)],
      ["commands run", String(s.execs)],
      ["steps", `${s.steps}${s.replays ? ` (+${s.replays} replayed)` : ""}`],
      ["OOM kills", h("span", { id: "job-oom", class: s.oom_kills ? "bad" : "" }, String(s.oom_kills))],
      ["all its sandboxes", h("a", { href: sandboxesHash({ labels: [`${s.key}=${s.value}`], state: "all" }) }, "the list")],
    ]));
    fill(p.resources, resources(s));
    fill(p.verifications, verifications(s));
    fill(p.rewards, rewards(s.rewards));
    fill(p.failures, failures(s));
    fill(p.findings, findings(s.findings));
    // The selection keeps only sandboxes still listed.
    const listed = new Set([...s.stuck, ...s.slowest].map((b) => b.id));
    for (const id of [...this.selected]) if (!listed.has(id)) this.selected.delete(id);
    fill(p.stuck, this.briefs(s.stuck, "stuck-table", `none stuck (after ${fmtSeconds(this.stuckAfter)})`, true));
    fill(p.slowest, this.briefs(s.slowest, "slowest-table", "no live sandboxes", false));
    this.showSelection();
  }

  /** A table of SandboxBrief rows, each with a box to pick it (the head's box: all of them). */
  briefs(rows, id, empty, withWhy) {
    const pick = (b) => {
      const box = h("input", { type: "checkbox", class: "pick", checked: this.selected.has(b.id), title: "select" });
      box.addEventListener("change", () => {
        if (box.checked) this.selected.add(b.id);
        else this.selected.delete(b.id);
        this.syncBoxes();
      });
      return box;
    };
    const all = h("input", { type: "checkbox", class: "pick-all", title: "select all", disabled: !rows.length });
    all.checked = rows.length > 0 && rows.every((b) => this.selected.has(b.id));
    all.addEventListener("change", () => {
      rows.forEach((b) => (all.checked ? this.selected.add(b.id) : this.selected.delete(b.id)));
      this.syncBoxes();
    });
    const now = Date.now() / 1000;
    const hasNode = rows.some((b) => b.node);
    return table(
      [
        { title: all, class: "pick-cell", cell: pick },
        { title: "sandbox", cell: (b) => h("a", { href: sandboxHash(b.id), class: "sb-link mono" }, b.id) },
        hasNode && { title: "node", cell: (b) => h("code", {}, b.node || "") },
        { title: "state", cell: (b) => stateBadge(b.state) },
        { title: "age", class: "num", cell: (b) => fmtSeconds(Math.max(0, Math.round(now - b.created_at))) },
        { title: "last activity", cell: (b) => agoCell(b.last_active_at) },
        withWhy && { title: "why", cell: (b) => h("span", { class: "chips" }, b.why.map((w) => h("span", { class: "chip chip-warn" }, w))) },
        { title: "cpu", class: "num", cell: (b) => (b.cpu == null ? "–" : `${fmtCores(b.cpu)} cores`) },
        { title: "memory", class: "num", cell: (b) => (b.memory == null ? "–" : fmtBytes(b.memory)) },
      ].filter(Boolean),
      rows,
      { id, empty, rowAttrs: (b) => ({ dataset: { id: b.id, state: b.state } }) },
    );
  }

  /** Every box (both tables, the rows drawn later too, their heads' boxes) as the selection says. */
  syncBoxes() {
    for (const part of [this.parts.stuck, this.parts.slowest]) {
      const boxes = [...part.querySelectorAll("tr[data-id] .pick")];
      boxes.forEach((box) => (box.checked = this.selected.has(box.closest("tr").dataset.id)));
      const all = part.querySelector(".pick-all");
      if (all) all.checked = boxes.length > 0 && boxes.every((box) => box.checked);
    }
    this.showSelection();
  }

  async drawCharts(s) {
    if (!this.charts) {
      if (!this.uplot) {
        await new Promise((painted) => requestAnimationFrame(() => setTimeout(painted)));
        this.uplot = loadUplot();
      }
      try {
        await this.uplot;
      } catch (err) {
        this.chartNote.textContent = `no charts: ${err.message}`;
        this.uplot = loadUplot(); // tried again at the next answer
        this.uplot.catch(() => {});
        return;
      }
      if (!this.ctx.alive) return;
      this.chartNote.textContent = "";
      const lines = (names, colors) => names.map((label, i) => ({ label, stroke: colors[i] }));
      const hosts = this.chartHosts;
      this.charts = {
        states: new LineChart(hosts.states, { lines: lines(STATES, STATE_COLORS), unit: "sandboxes", digits: 0 }),
        lifecycle: new LineChart(hosts.lifecycle, { lines: lines(["creates/s", "stops/s", "refused/s"], ["#4cc38a", "#f0706a", "#e3a35e"]), unit: "per s" }),
        work: new LineChart(hosts.work, { lines: lines(["steps/s", "commands/s"], ["#5aa9ff", "#e3a35e"]), unit: "per s" }),
        failures: new LineChart(hosts.failures, { lines: lines(CAUSES, CAUSE_COLORS), unit: "per min" }),
      };
    }
    const pts = s.series;
    const t = pts.map((p) => p.t);
    const per = (n) => n / s.bucket;
    this.charts.states.set(t, STATES.map((st) => pts.map((p) => p.states[st] || 0)));
    this.charts.lifecycle.set(t, [pts.map((p) => per(p.created)), pts.map((p) => per(p.stopped)), pts.map((p) => per(p.refused || 0))]);
    this.charts.work.set(t, [pts.map((p) => per(p.steps)), pts.map((p) => per(p.execs))]);
    this.charts.failures.set(t, CAUSES.map((c) => pts.map((p) => per(p.failures[c] || 0) * 60)));
    this.chartNote.textContent = pts.length ? "" : "nothing counted yet";
  }

  // -- trajectories ----------------------------------------------------------------------------------

  async pollTrajectories() {
    const key = await this.keyKnown;
    // the newest only, and how many in all (an older daemon answers them all, without `total`)
    const answer = await api("/v1/trajectories", { query: { label: `${key}=${this.value}`, limit: TRAJECTORIES_SHOWN } });
    if (!this.ctx.alive) return;
    const text = JSON.stringify(answer);
    if (text === this.shownTrajectories) return;
    this.shownTrajectories = text;
    const trajectories = answer.trajectories.sort((a, b) => b.created_at - a.created_at);
    const shown = trajectories.slice(0, TRAJECTORIES_SHOWN);
    const total = answer.total ?? trajectories.length;
    fill(
      this.parts.trajectories,
      trajectoryTable(shown, this.value),
      total > shown.length && note(`the newest ${shown.length} of ${total}`, "trajectories-note"),
      total <= shown.length && total > 0 && note(`${total} in all`, "trajectories-note"),
    );
  }

  dispose() {
    if (this.charts) Object.values(this.charts).forEach((c) => c.destroy());
  }
}

// -- the parts ---------------------------------------------------------------------------------------

function stateCounts(states) {
  const names = [...STATES, ...Object.keys(states).filter((k) => !STATES.includes(k))];
  const shown = names.filter((k) => states[k]);
  if (!shown.length) return note("no sandboxes now");
  return h(
    "div",
    { class: "state-counts" },
    shown.map((k) => h("span", { class: "state-count", dataset: { state: k } }, h("strong", {}, String(states[k])), stateBadge(k))),
  );
}

function failures(s) {
  const rows = Object.entries(s.failures).filter(([, n]) => n).sort((a, b) => b[1] - a[1]);
  const total = rows.reduce((n, [, c]) => n + c, 0);
  return [
    table(
      [
        { title: "cause", cell: ([c]) => causeBadge(c) },
        { title: "failures", class: "num", cell: ([, n]) => String(n) },
        { title: "share", class: "num", cell: ([, n]) => fmtShare(n / total) },
      ],
      rows,
      { id: "failures-table", empty: "no failures", rowAttrs: ([c]) => ({ dataset: { cause: c } }) },
    ),
    h("h3", {}, "latest"),
    table(
      [
        { title: "when", cell: (e) => agoCell(e.at) },
        { title: "cause", cell: (e) => causeBadge(e.cause) },
        { title: "kind", cell: (e) => e.kind },
        { title: "message", class: "mono small", cell: (e) => h("span", { title: e.message }, cut(e.message, 200)) },
        {
          title: "where",
          cell: (e) =>
            h(
              "span",
              { class: "links" },
              e.sandbox_id && h("a", { href: sandboxHash(e.sandbox_id), class: "mono sb-link" }, e.sandbox_id),
              e.trajectory_id && h("a", { href: trajectoryHash(e.trajectory_id, s.value), class: "mono traj-link" }, e.step == null ? e.trajectory_id : `${e.trajectory_id} step ${e.step}`),
            ),
        },
      ],
      s.examples,
      { id: "examples-table", empty: "none", rowAttrs: (e) => ({ dataset: { cause: e.cause, kind: e.kind } }) },
    ),
    (s.refusals || []).length > 0 && h("h3", {}, "creates refused (not failures: the caller is told and may retry)"),
    (s.refusals || []).length > 0 &&
      table(
        [
          { title: "when", cell: (e) => agoCell(e.at) },
          { title: "why", class: "mono small", cell: (e) => h("span", { title: e.message }, cut(e.message, 200)) },
        ],
        s.refusals,
        { id: "refusals-table", empty: "none" },
      ),
  ];
}

/** Creates refused before a sandbox existed, by why: `5 (quota 3, capacity 2)`. */
function refused(byWhy) {
  const rows = Object.entries(byWhy).filter(([, n]) => n).sort((a, b) => b[1] - a[1]);
  const total = rows.reduce((n, [, c]) => n + c, 0);
  const text = total ? `${total} (${rows.map(([w, n]) => `${w} ${n}`).join(", ")})` : "0";
  return h("span", { id: "job-refused", class: total ? "warn" : "", title: "refused before a sandbox existed: a quota, the node full or draining" }, text);
}

function verifications(s) {
  const v = s.verifications || {};
  const total = Object.values(v).reduce((n, c) => n + c, 0);
  const outcomes = Object.entries(v).filter(([, n]) => n).sort((a, b) => b[1] - a[1]);
  return [
    h("div", { class: "big-number" }, h("span", { id: "job-pass-rate" }, fmtShare(s.pass_rate)), h("span", { class: "muted" }, ` passed of ${total} verified`)),
    table(
      [
        { title: "outcome", cell: ([o]) => (o === "passed" ? h("span", { class: "badge badge-ok" }, "passed") : causeBadge(o)) },
        { title: "verifications", class: "num", cell: ([, n]) => String(n) },
      ],
      outcomes,
      { id: "verifications-table", empty: "none yet", rowAttrs: ([o]) => ({ dataset: { outcome: o } }) },
    ),
  ];
}

const binLabel = (b) => (b.lo === null ? `< ${b.hi}` : b.hi === null ? `> ${b.lo}` : `${b.lo}`);
const binRange = (b) => (b.lo !== null && b.lo === b.hi ? `exactly ${b.lo}` : `[${b.lo ?? "-∞"}, ${b.hi ?? "∞"})`);

function rewards(r) {
  const top = Math.max(1, ...r.bins.map((b) => b.count));
  return [
    h(
      "div",
      { class: "reward-bars", id: "reward-bars" },
      r.bins.map((b) =>
        h(
          "div",
          { class: "reward-bin", title: `${binRange(b)}: ${b.count}`, dataset: { count: String(b.count) } },
          h("div", { class: "reward-bar-area" }, h("div", { class: "reward-bar", style: `height: ${(b.count / top) * 100}%` })),
          h("span", { class: "reward-label" }, binLabel(b)),
        ),
      ),
    ),
    facts([
      ["rewards", h("span", { id: "reward-count" }, String(r.count))],
      ["mean", h("span", { id: "reward-mean" }, fmtNumber(r.mean))],
      ["min – max", r.count ? `${fmtNumber(r.min)} – ${fmtNumber(r.max)}` : "–"],
    ]),
  ];
}

function findings(counts) {
  const rows = Object.entries(counts || {}).filter(([, n]) => n).sort((a, b) => b[1] - a[1]);
  return table(
    [
      { title: "detector", cell: ([d]) => h("code", {}, d) },
      { title: "findings", class: "num", cell: ([, n]) => String(n) },
    ],
    rows,
    { id: "findings-table", empty: "no findings", rowAttrs: ([d]) => ({ dataset: { detector: d } }) },
  );
}

function resources(s) {
  return [
    facts([
      ["CPU used", meter(s.cpu_used, s.cpu, `${fmtCores(s.cpu_used)} of ${fmtCores(s.cpu)} cores (limits)`, { id: "job-cpu" })],
      ["memory used", meter(s.memory_used, s.memory, `${fmtBytes(s.memory_used)} of ${fmtBytes(s.memory)} (limits)`, { id: "job-memory" })],
    ]),
    s.quotas.length ? h("h3", {}, "projects against their quotas") : null,
    s.quotas.length ? quotaTable(s.quotas, "job-quotas") : null,
  ];
}

function trajectoryTable(rows, job) {
  return table(
    [
      { title: "trajectory", cell: (t) => h("a", { href: trajectoryHash(t.id, job), class: "mono traj-link" }, t.id) },
      { title: "state", cell: (t) => h("span", { class: `badge traj-${t.state}` }, t.state) },
      { title: "steps", class: "num", cell: (t) => String(t.steps) },
      { title: "reward", class: "num", cell: (t) => fmtNumber(t.reward) },
      { title: "verification", cell: (t) => verdictBadge(t.verification) },
      { title: "failures", cell: (t) => countChips(t.failures, { cls: (c) => `cause-${c}` }) },
      { title: "labels", cell: (t) => labelChips(t.labels) },
      { title: "created", cell: (t) => timeCell(t.created_at) },
    ],
    rows,
    { id: "trajectories-table", empty: "no trajectories carry the job's label", rowAttrs: (t) => ({ dataset: { id: t.id } }) },
  );
}
