// #/audit?kind=api&sandbox=<id> : the node's audit stream (GET /v1/audit), newest first: the newest
// records in one call (`newest=true`), then those that come (read on from the last seq every 3 s).

import { ApiError, api } from "../api.js";
import { h, labelChips, note, pageHead, table, timeCell } from "../ui.js";

const SHOWN = 300;
const KINDS = ["", "api", "connection", "finding", "oom_kill", "pids_limit", "output_truncated", "network_policy", "agent_attack"];
const PAGE = 5000;

export async function auditPage(root, ctx) {
  const filter = { kind: ctx.query.get("kind") || "", sandbox_id: ctx.query.get("sandbox") || "" };
  const body = h("div", { id: "audit" });
  root.append(pageHead("Audit", h("span", { class: "muted" }, "API calls, connections, limits hit, findings")), auditForm(filter), body);

  let page;
  try {
    page = await api("/v1/audit", { query: { ...query(filter), newest: true, limit: SHOWN } });
  } catch (err) {
    if (!(err instanceof ApiError) || err.status >= 500 || err.status === 401) throw err;
    body.replaceChildren(note(`The audit stream is not available here (${err.code}: ${err.message}).`));
    return;
  }
  if (!ctx.alive) return;
  let records = page.records.reverse(); // newest first
  let lastSeq = page.last_seq;
  body.replaceChildren(auditTable(records));
  await ctx.every(
    3000,
    async () => {
      const more = await api("/v1/audit", { query: { ...query(filter), since: lastSeq, limit: PAGE } });
      if (!ctx.alive) return;
      lastSeq = more.last_seq;
      if (!more.records.length) return;
      records = more.records.reverse().concat(records).slice(0, SHOWN);
      body.replaceChildren(auditTable(records));
    },
    { wait: true },
  );
}

const query = (filter) => ({ kind: filter.kind || undefined, sandbox_id: filter.sandbox_id || undefined });

function auditForm(filter) {
  const kind = h("select", { id: "audit-kind" }, KINDS.map((k) => h("option", { value: k, selected: k === filter.kind }, k || "all kinds")));
  const sandbox = h("input", { id: "audit-sandbox", placeholder: "sb-…", value: filter.sandbox_id });
  const form = h("form", { class: "filters" }, h("label", {}, "kind", kind), h("label", {}, "sandbox", sandbox), h("button", { type: "submit", class: "primary" }, "Show"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const q = new URLSearchParams();
    if (kind.value) q.set("kind", kind.value);
    if (sandbox.value.trim()) q.set("sandbox", sandbox.value.trim());
    location.hash = `#/audit${q.toString() ? `?${q}` : ""}`;
  });
  return form;
}

function auditTable(records) {
  return table(
    [
      { title: "time", cell: (r) => timeCell(r.ts) },
      { title: "kind", cell: (r) => h("span", { class: `badge kind-${r.kind}` }, r.kind) },
      { title: "actor", class: "mono small", cell: (r) => r.actor || "" },
      { title: "sandbox", cell: (r) => (r.sandbox_id ? h("a", { href: `#/sandboxes/${encodeURIComponent(r.sandbox_id)}`, class: "mono" }, r.sandbox_id) : "") },
      { title: "what", class: "mono small", cell: (r) => describe(r) },
      { title: "labels", cell: (r) => (r.labels ? labelChips(r.labels) : "") },
    ],
    records,
    { id: "audit-table", empty: "no records" },
  );
}

function describe(r) {
  const d = r.data || {};
  if (r.kind === "api") return `${d.method} ${d.path} → ${d.status} (${d.ms} ms)`;
  return Object.entries(d)
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ");
}
