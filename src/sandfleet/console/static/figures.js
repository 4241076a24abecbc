// What the job, trajectory, alerts and cluster pages share: links to those pages, badges of failure
// causes and verdicts, projects against their quotas.

import { fmtBytes, fmtCores, h, meter, table } from "./ui.js";

/** `#/jobs/<value>` (the value one path segment), with a query. */
export function jobHash(value, query = {}) {
  const q = new URLSearchParams(query).toString();
  return `#/jobs/${encodeURIComponent(value)}${q ? `?${q}` : ""}`;
}

/** `#/trajectories/<id>`; `job`: the job page it was reached from (its back link). */
export const trajectoryHash = (id, job) =>
  `#/trajectories/${encodeURIComponent(id)}${job ? `?job=${encodeURIComponent(job)}` : ""}`;

export const sandboxHash = (id) => `#/sandboxes/${encodeURIComponent(id)}`;

/** Whose fault a failure was: infra, agent, timeout, verifier, caller. */
export const causeBadge = (cause) => h("span", { class: `badge cause cause-${cause}` }, cause);

/** A verification's verdict in a word: passed, or failed and whose fault (none: not verified). */
export function verdictBadge(v) {
  if (!v) return h("span", { class: "muted" }, "–");
  if (v.passed) return h("span", { class: "badge badge-ok verdict" }, "passed");
  return h("span", { class: "badge badge-bad verdict" }, `failed: ${v.cause || "?"}`);
}

/** `text` cut to `n` characters (an ellipsis if it was longer). */
export const cut = (text, n) => (text && text.length > n ? `${text.slice(0, n)}…` : text || "");

/** QuotaUse rows: each figure against its quota (a meter), or alone when there is none. */
export function quotaTable(rows, id) {
  const cores = (n) => `${fmtCores(n)} cores`;
  const against = (used, quota, fmt) =>
    quota == null
      ? h("span", {}, fmt(used), h("span", { class: "muted" }, " (no quota)"))
      : meter(used, quota, `${fmt(used)} of ${fmt(quota)}`);
  return table(
    [
      { title: "project", cell: (q) => (q.project ? h("code", {}, q.project) : h("span", { class: "muted" }, "(none)")) },
      { title: "sandboxes", cell: (q) => against(q.sandboxes, q.quota_sandboxes, String) },
      { title: "CPU limits", cell: (q) => against(q.cpu, q.quota_cpu, cores) },
      { title: "memory limits", cell: (q) => against(q.memory, q.quota_memory, fmtBytes) },
    ],
    rows,
    { id, empty: "no projects", rowAttrs: (q) => ({ dataset: { project: q.project } }) },
  );
}
