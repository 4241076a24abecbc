// #/cluster : through a cluster gateway (which serves this console too), its nodes (GET
// /v1/cluster/nodes): status, load, images, placements; drain or undrain one (a root admin token);
// and the projects against their quotas. A token scoped to a project is answered fewer fields: what
// is there is shown.

import { api } from "../api.js";
import { quotaTable } from "../figures.js";
import { actionButton, card, fmtNumber, h, labelChips, meter, notify, pageHead, setEnabled, table, timeCell } from "../ui.js";

const POLL_MS = 5000;

export async function clusterPage(root, ctx) {
  const summary = h("span", { class: "muted", id: "cluster-summary" });
  const nodes = h("div", { id: "cluster-nodes" });
  const projects = h("div", { id: "cluster-projects" });
  const gateways = h("div", { id: "cluster-gateways" });
  root.append(
    pageHead("Cluster", summary),
    h("div", { class: "stack" }, card("Nodes", { wide: true }, nodes), h("div", { class: "grid grid-2" }, card("Projects", {}, projects), card("Gateways", {}, gateways))),
  );
  let shown = null; // the answer drawn (JSON): the same again is not drawn again
  const refresh = async () => {
    const answer = await api("/v1/cluster/nodes");
    if (!ctx.alive) return;
    const text = JSON.stringify(answer);
    if (text === shown) return;
    shown = text;
    const by = (s) => answer.nodes.filter((n) => n.status === s).length;
    summary.textContent = `${answer.nodes.length} nodes: ${by("alive")} alive, ${by("draining")} draining, ${by("unreachable")} unreachable, ${by("lost")} lost`;
    nodes.replaceChildren(nodeTable(ctx, answer.nodes, refresh));
    projects.replaceChildren(quotaTable(answer.projects || [], "cluster-projects-table"));
    const known = answer.gateways || [];
    gateways.replaceChildren(
      known.length ? h("ul", { class: "plain" }, known.map((g) => h("li", {}, h("code", {}, typeof g === "string" ? g : JSON.stringify(g))))) : h("p", { class: "note" }, "none registered (a fixed list of nodes: no discovery)"),
    );
  };
  await ctx.every(POLL_MS, refresh);
}

const statusBadge = (status) => h("span", { class: `badge node-${status}` }, status);

function nodeTable(ctx, nodes, refresh) {
  const root = !ctx.me?.project; // a token scoped to a project drains nothing
  const has = (field) => nodes.some((n) => n[field] !== undefined);
  return table(
    [
      { title: "node", cell: (n) => h("code", {}, n.key) },
      { title: "group", cell: (n) => n.group },
      { title: "status", cell: (n) => statusBadge(n.status) },
      { title: "load", cell: (n) => load(n.load) },
      { title: "labels", cell: (n) => labelChips(n.load?.labels) },
      { title: "tiers", cell: (n) => (n.load?.tiers || []).join(", ") || "–" },
      { title: "images", cell: (n) => images(n.load?.images) },
      has("placed") && { title: "placed", class: "num", cell: (n) => (n.placed == null ? "–" : String(n.placed)) },
      has("generation") && { title: "generation", class: "num", cell: (n) => String(n.generation ?? "–") },
      has("load_age") && { title: "read", class: "num", cell: (n) => (n.load_age == null ? "never" : `${fmtNumber(n.load_age, 1)} s ago`) },
      has("lost_at") && { title: "lost", cell: (n) => (n.lost_at == null ? "" : timeCell(n.lost_at)) },
      has("url") && { title: "url", class: "mono small", cell: (n) => n.url },
      { title: "", class: "actions", cell: (n) => drainButton(ctx, n, root, refresh) },
    ].filter(Boolean),
    nodes,
    { id: "nodes-table", empty: "no nodes", rowAttrs: (n) => ({ dataset: { key: n.key, status: n.status } }) },
  );
}

function load(l) {
  if (!l) return h("span", { class: "muted" }, "not read");
  if (l.sandboxes === undefined) return l.draining ? h("span", { class: "badge badge-warn" }, "draining") : "–";
  return h(
    "span",
    { class: "node-load" },
    meter(l.sandboxes, l.capacity, `${l.sandboxes} / ${l.capacity} sandboxes`),
    l.draining ? h("span", { class: "badge badge-warn" }, "draining") : null,
  );
}

function images(list) {
  if (!list) return h("span", { class: "muted" }, "–");
  if (!list.length) return "0";
  return h("details", { class: "images" }, h("summary", {}, `${list.length} cached`), h("span", { class: "chips" }, list.map((i) => h("code", { class: "chip" }, i))));
}

function drainButton(ctx, n, root, refresh) {
  const draining = Boolean(n.load?.draining);
  const btn = actionButton(
    ctx,
    draining ? "Undrain" : "Drain",
    async () => {
      await api(`/v1/cluster/nodes/${encodeURIComponent(n.key)}/drain`, { method: "POST", body: { draining: !draining } });
      notify(`${draining ? "undrained" : "drained"} node ${n.key}`);
      await refresh();
    },
    { title: draining ? "take creates again" : "take no new creates" },
  );
  btn.classList.add("drain");
  setEnabled(btn, root && n.status !== "lost");
  if (!root) btn.title = "draining a node takes a root admin token";
  return btn;
}
