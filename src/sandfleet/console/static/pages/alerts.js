// #/alerts : the alerts firing now (GET /v1/alerts: the daemon evaluates its rules; a gateway, over its
// nodes), read every 10 s; and their count in the top bar, which app.js keeps while signed in.

import { ApiError, api } from "../api.js";
import { jobHash } from "../figures.js";
import { agoCell, fmtNumber, fmtTime, h, labelChips, note, pageHead, table } from "../ui.js";

export const ALERTS_MS = 10_000;
const ORDER = { critical: 0, warning: 1 };

/** The top bar's badge: how many fire (hidden at 0), red when one is critical. */
export function showAlertCount(alerts) {
  const badge = document.getElementById("alerts-count");
  badge.textContent = String(alerts.length);
  badge.hidden = alerts.length === 0;
  badge.classList.toggle("badge-bad", alerts.some((a) => a.severity === "critical"));
  badge.title = alerts.map((a) => `${a.severity}: ${a.summary}`).join("\n");
}

export async function alertsPage(root, ctx) {
  const summary = h("span", { class: "muted", id: "alerts-summary" });
  const body = h("div", { id: "alerts" });
  root.append(pageHead("Alerts", summary), body);
  let shown = null; // the alerts drawn (JSON): the same again is not drawn again
  await ctx.every(ALERTS_MS, async () => {
    let answer;
    try {
      answer = await api("/v1/alerts");
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) throw err;
      body.replaceChildren(note("This daemon evaluates no alerts (a version without GET /v1/alerts)."));
      return;
    }
    if (!ctx.alive) return;
    showAlertCount(answer.alerts);
    summary.textContent = `${answer.alerts.length} firing · evaluated at ${fmtTime(answer.at)}`;
    const text = JSON.stringify(answer.alerts);
    if (text === shown) return;
    shown = text;
    const rows = [...answer.alerts].sort((a, b) => ORDER[a.severity] - ORDER[b.severity] || a.since - b.since);
    body.replaceChildren(alertTable(rows));
  });
}

function alertTable(rows) {
  return table(
    [
      { title: "severity", cell: (a) => h("span", { class: `badge severity-${a.severity}` }, a.severity) },
      { title: "alert", cell: (a) => h("code", {}, a.name) },
      { title: "summary", cell: (a) => a.summary },
      { title: "labels", cell: (a) => labelChips(a.labels) },
      { title: "value", class: "num", cell: (a) => h("span", { title: "value / threshold" }, `${fmtNumber(a.value)} / ${fmtNumber(a.threshold)}`) },
      { title: "since", cell: (a) => agoCell(a.since) },
      { title: "", cell: (a) => links(a.labels) },
    ],
    rows,
    { id: "alerts-table", empty: "nothing fires", rowAttrs: (a) => ({ dataset: { name: a.name, severity: a.severity } }) },
  );
}

/** Where to look: the job's page, the cluster's, the detector's findings. */
function links(labels) {
  return h(
    "span",
    { class: "links" },
    labels.job && h("a", { href: jobHash(labels.job), class: "job-link" }, "job"),
    labels.node && h("a", { href: "#/cluster" }, "cluster"),
    labels.detector && h("a", { href: "#/audit?kind=finding" }, "findings"),
  );
}
