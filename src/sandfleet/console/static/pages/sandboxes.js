// #/sandboxes?label=k=v&state=live&project=p&after=<cursor>&limit=200 : the sandboxes, filtered, a page at a
// time (newest first).

import { listSandboxes } from "../api.js";
import { fmtBytes, fmtCores, h, labelChips, note, pageHead, stateBadge, table, timeCell } from "../ui.js";

const PAGE = 200; // rows a page shows unless the hash says `limit`
const STATES = ["live", "all", "creating", "running", "paused", "stopping", "stopped", "failed"];
export const PROJECT_LABEL = "sandfleet.project"; // a label selector's key that selects by project

// The cursors of the pages before this one, per filter: Prev pops one (lost on a reload: then Prev
// goes back to the first page).
const cursors = new Map();

/** The filter in the hash: {labels: ["k=v"], state, project, after}. */
export function readFilter(query) {
  return {
    labels: query.getAll("label").filter(Boolean),
    state: query.get("state") || "live",
    project: query.get("project") || "",
    after: query.get("after") || "",
    limit: Math.min(1000, Math.max(1, parseInt(query.get("limit"), 10) || PAGE)),
  };
}

export function sandboxesHash({ labels = [], state = "live", project = "", after = "", limit = PAGE }) {
  const q = new URLSearchParams();
  labels.forEach((l) => q.append("label", l));
  if (state !== "live") q.set("state", state);
  if (project) q.set("project", project);
  if (after) q.set("after", after);
  if (limit !== PAGE) q.set("limit", String(limit));
  const qs = q.toString();
  return `#/sandboxes${qs ? `?${qs}` : ""}`;
}

export async function sandboxesPage(root, ctx) {
  const filter = readFilter(ctx.query);
  const key = JSON.stringify([filter.labels, filter.state, filter.project, filter.limit]);
  const summary = h("span", { id: "list-summary", class: "muted" });
  const list = h("div", { id: "sandbox-list" });
  const pager = h("div", { class: "pager" });
  root.append(pageHead("Sandboxes", summary), filterForm(filter), list, pager);

  const selector = [...filter.labels, ...(filter.project ? [`${PROJECT_LABEL}=${filter.project}`] : [])];
  let shown = null; // the page drawn: the same again is not drawn again
  await ctx.every(5000, async () => {
    const { limit } = filter;
    const page = await listSandboxes({ labels: selector, state: filter.state, limit, after: filter.after || undefined });
    if (!ctx.alive) return;
    const text = JSON.stringify(page);
    if (text === shown) return;
    shown = text;
    const rows = page.sandboxes.slice(0, limit); // a daemon that does not page answers everything
    const before = cursors.get(key) || [];
    const first = filter.after ? before.length * limit + 1 : 1;
    summary.textContent = rows.length
      ? `${first}–${first + rows.length - 1} of ${page.total} matching`
      : `${page.total} matching`;
    list.replaceChildren(sandboxTable(rows));
    if (page.sandboxes.length > limit) list.append(note(`showing the first ${limit} of ${page.sandboxes.length}`));
    pager.replaceChildren(
      h("button", { type: "button", id: "prev-page", disabled: !filter.after, onclick: () => goPrev(filter, key) }, "‹ Prev"),
      h("button", { type: "button", id: "next-page", disabled: !page.next, onclick: () => goNext(filter, key, page.next) }, "Next ›"),
    );
  });
}

function goNext(filter, key, next) {
  cursors.set(key, [...(cursors.get(key) || []), filter.after]);
  location.hash = sandboxesHash({ ...filter, after: next });
}

function goPrev(filter, key) {
  const stack = [...(cursors.get(key) || [])];
  const after = stack.pop() || "";
  cursors.set(key, stack);
  location.hash = sandboxesHash({ ...filter, after });
}

function filterForm(filter) {
  const labels = h("input", {
    id: "filter-labels",
    name: "labels",
    placeholder: "job=grpo-7 team=rl",
    value: filter.labels.join(" "),
    title: "labels the sandboxes carry, k=v, space separated (all must match)",
  });
  const state = h("select", { id: "filter-state", name: "state" }, STATES.map((s) => h("option", { value: s, selected: s === filter.state }, s)));
  const project = h("input", { id: "filter-project", name: "project", placeholder: "org/team", value: filter.project });
  const form = h(
    "form",
    { class: "filters", id: "filters" },
    h("label", {}, "labels", labels),
    h("label", {}, "state", state),
    h("label", {}, "project", project),
    h("button", { type: "submit", class: "primary" }, "Filter"),
    h("a", { href: "#/sandboxes", class: "link-button" }, "clear"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const parsed = labels.value.split(/[\s,]+/).filter(Boolean);
    const bad = parsed.find((l) => !/^[^=]+=/.test(l));
    labels.setCustomValidity(bad ? `"${bad}" is not k=v` : "");
    if (bad) return labels.reportValidity();
    location.hash = sandboxesHash({ labels: parsed, state: state.value, project: project.value.trim(), limit: filter.limit });
  });
  return form;
}

export function sandboxTable(rows) {
  return table(
    [
      { title: "id", cell: (s) => h("a", { href: `#/sandboxes/${encodeURIComponent(s.id)}`, class: "sb-link mono" }, s.id) },
      { title: "state", cell: (s) => stateBadge(s.state) },
      { title: "image", cell: (s) => imageOf(s.spec) },
      { title: "tier", cell: (s) => s.spec.backend },
      { title: "project", cell: (s) => s.spec.project || h("span", { class: "muted" }, "–") },
      { title: "labels", cell: (s) => labelChips(s.spec.labels) },
      { title: "created", cell: (s) => timeCell(s.created_at) },
      { title: "cpu", class: "num", cell: (s) => fmtCores(s.spec.resources?.cpu) },
      { title: "memory", class: "num", cell: (s) => fmtBytes(s.spec.resources?.memory) },
    ],
    rows,
    { id: "sandboxes", empty: "no sandboxes match", rowAttrs: (s) => ({ dataset: { id: s.id, state: s.state } }) },
  );
}

export function imageOf(spec) {
  const layers = spec.layers?.length ? ` + ${spec.layers.length} layer${spec.layers.length > 1 ? "s" : ""}` : "";
  return `${spec.image || "busybox"}${layers}`;
}
