// #/jobs?key=job&state=live : sandboxes grouped by one label's values ("a job is a label"), counted by
// state (GET /v1/jobs: the node counts, the page gets no sandbox); a job paused, resumed or stopped at
// once (POST /v1/sandboxes/pause|resume|stop by label). Grouped by the node's job label (`counted`),
// each job also has its failures, pass rate and steps, and a page of its own (#/jobs/<value>).

import { api } from "../api.js";
import { jobHash } from "../figures.js";
import { actionButton, fill, fmtShare, h, notify, pageHead, table } from "../ui.js";
import { sandboxesHash } from "./sandboxes.js";

const STATES = ["creating", "running", "paused", "stopping", "stopped", "failed"];

export async function jobsPage(root, ctx) {
  const key = ctx.query.get("key") || "job";
  const state = ctx.query.get("state") || "live";
  const summary = h("span", { class: "muted", id: "jobs-summary" });
  const body = h("div", { id: "jobs" });
  root.append(pageHead("Jobs", summary), jobsForm(key, state), body);

  let shown = null; // the answer drawn: the same one again is not drawn again
  const refresh = async () => {
    const answer = await api("/v1/jobs", { query: { key, state } });
    if (!ctx.alive) return;
    const text = JSON.stringify(answer);
    if (text === shown) return;
    shown = text;
    const jobs = answer.jobs.filter((j) => j.value !== null);
    const without = answer.jobs.find((j) => j.value === null)?.count || 0;
    summary.textContent =
      `${jobs.length} values of label "${key}" over ${answer.total - without} ${state} sandboxes` +
      (without ? ` (${without} without it)` : "");
    fill(body, jobsTable(ctx, key, state, jobs, refresh, Boolean(answer.counted)));
  };
  await ctx.every(5000, refresh);
}

function jobsForm(key, state) {
  const keyInput = h("input", { id: "job-key", name: "key", value: key, title: "the label whose values are the jobs" });
  const stateSelect = h("select", { id: "job-state" }, ["live", "all"].map((s) => h("option", { value: s, selected: s === state }, s)));
  const form = h("form", { class: "filters" }, h("label", {}, "label key", keyInput), h("label", {}, "sandboxes", stateSelect), h("button", { type: "submit", class: "primary" }, "Group"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const q = new URLSearchParams({ key: keyInput.value.trim() || "job", state: stateSelect.value });
    location.hash = `#/jobs?${q}`;
  });
  return form;
}

const figure = (n) => (n == null ? "–" : String(n));

function jobsTable(ctx, key, state, jobs, refresh, counted) {
  const states = STATES.filter((s) => jobs.some((j) => j.states[s]));
  const list = (j) => sandboxesHash({ labels: [`${key}=${j.value}`], state });
  // The node's job label: a job's page; another label: its values are no jobs, their link is the list.
  const name = counted
    ? (j) => [h("a", { href: jobHash(j.value), class: "job-link" }, j.value), " ", h("a", { href: list(j), class: "list-link small" }, "sandboxes")]
    : (j) => h("a", { href: list(j), class: "job-link" }, j.value);
  return table(
    [
      { title: key, cell: name },
      { title: "sandboxes", class: "num", cell: (j) => String(j.count) },
      ...states.map((s) => ({ title: s, class: "num", cell: (j) => String(j.states[s] || "") })),
      ...(counted
        ? [
            { title: "failures", class: "num", cell: (j) => figure(j.failures) },
            { title: "pass rate", class: "num", cell: (j) => (j.verified ? `${fmtShare(j.passed / j.verified)} of ${j.verified}` : "–") },
            { title: "steps", class: "num", cell: (j) => figure(j.steps) },
          ]
        : []),
      { title: "", class: "actions", cell: (j) => jobActions(ctx, { [key]: j.value }, refresh) },
    ],
    jobs,
    { id: "jobs-table", empty: `no sandboxes carry the label "${key}"`, rowAttrs: (j) => ({ dataset: { job: j.value } }) },
  );
}

function jobActions(ctx, labels, refresh) {
  const name = Object.entries(labels).map(([k, v]) => `${k}=${v}`)[0];
  const call = (verb) => async () => {
    const res = await api(`/v1/sandboxes/${verb}`, { method: "POST", body: { labels } });
    const ids = res.stopped || res.sandboxes || [];
    notify(`${verb}: ${ids.length} sandbox${ids.length === 1 ? "" : "es"} of ${name}`);
    await refresh();
  };
  return h(
    "span",
    { class: "row-actions" },
    actionButton(ctx, "Pause", call("pause"), { title: `pause every running sandbox of ${name}` }),
    actionButton(ctx, "Resume", call("resume")),
    actionButton(ctx, "Stop", call("stop"), { danger: true, confirm: "Stop all?", title: `stop every sandbox of ${name}` }),
  );
}
