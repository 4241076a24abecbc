// #/ : the node: its version and tiers (GET /v1/health), its load (GET /v1/node/load).

import { api } from "../api.js";
import { card, facts, fill, fmtBytes, fmtCores, fmtTime, h, labelChips, pageHead, table } from "../ui.js";

export async function nodePage(root, ctx) {
  const body = h("div", { class: "grid" });
  root.append(pageHead("Node"), body);
  await ctx.every(5000, async () => {
    const [health, load] = await Promise.all([api("/v1/health"), api("/v1/node/load")]);
    if (ctx.alive) fill(body, summary(health, load), capacity(load), tiers(health), projects(load), pools(health));
  });
}

function summary(health, load) {
  return card(
    "This node",
    {},
    facts([
      ["status", h("span", { class: `badge ${health.status === "ok" ? "badge-ok" : "badge-warn"}` }, health.status)],
      ["version", h("span", { id: "node-version" }, health.version)],
      ["key", h("code", {}, load.key)],
      ["group", load.group],
      ["draining", load.draining ? h("span", { class: "badge badge-warn" }, "draining: no new creates") : "no"],
      ["node labels", labelChips(load.labels)],
      ["read at", fmtTime(load.at)],
    ]),
  );
}

function capacity(load) {
  const used = load.sandboxes;
  const share = load.capacity ? Math.min(1, used / load.capacity) : 0;
  return card(
    "Capacity",
    {},
    h("div", { class: "big-number" }, h("span", { id: "node-live" }, String(used)), h("span", { class: "muted" }, ` / ${load.capacity} sandboxes`)),
    h("div", { class: "meter", title: `${Math.round(share * 100)}% of max_sandboxes` }, h("div", { class: "meter-fill", style: `width: ${share * 100}%` })),
    facts([
      ["live sandboxes", `${used} (creating, running, paused, stopping)`],
      ["images in the store", String((load.images || []).length)],
    ]),
  );
}

function tiers(health) {
  const rows = Object.entries(health.tiers || {}).map(([tier, caps]) => ({ tier, caps }));
  if (!rows.length) rows.push(...(health.backends || []).map((tier) => ({ tier, caps: [] })));
  return card(
    "Isolation tiers",
    {},
    table(
      [
        { title: "tier", cell: (r) => h("strong", {}, r.tier) },
        { title: "capabilities", cell: (r) => h("span", { class: "chips" }, r.caps.map((c) => h("span", { class: "chip" }, c))) },
      ],
      rows,
      { id: "tiers" },
    ),
  );
}

function projects(load) {
  const rows = Object.entries(load.projects || {}).map(([project, u]) => ({ project, ...u }));
  return card(
    "Usage by project",
    {},
    table(
      [
        { title: "project", cell: (r) => (r.project ? h("code", {}, r.project) : h("span", { class: "muted" }, "(none)")) },
        { title: "sandboxes", class: "num", cell: (r) => String(r.sandboxes) },
        { title: "CPU limits", class: "num", cell: (r) => `${fmtCores(r.cpu)} cores` },
        { title: "memory limits", class: "num", cell: (r) => fmtBytes(r.memory) },
      ],
      rows,
      { empty: "no live sandboxes" },
    ),
  );
}

function pools(health) {
  const rows = Object.entries(health.pools || {}).map(([pool, ready]) => ({ pool, ready }));
  if (!rows.length) return null;
  return card(
    "Warm pools",
    {},
    table(
      [
        { title: "pool", cell: (r) => h("code", {}, r.pool) },
        { title: "ready", class: "num", cell: (r) => String(r.ready) },
      ],
      rows,
    ),
  );
}
