// #/trajectories/<id>?job=<value> : one rollout: what it is (GET /v1/trajectories/{id}), its steps in
// order (.../steps) with what each asked (the record's actions, .../record), its verification's
// verdict, and the record itself (to run it again). The trajectory is read every 5 s; its steps and
// record again only when it changed (a closed one does not).

import { ApiError, api } from "../api.js";
import { causeBadge, cut, jobHash, sandboxHash, verdictBadge } from "../figures.js";
import { card, countChips, facts, fill, fmtBytes, fmtNumber, h, labelChips, note, pageHead, table, timeCell } from "../ui.js";

const POLL_MS = 5000;
const STEPS_SHOWN = 1000; // rows drawn before "Show all"

const trajectoryPath = (id, rest = "") => `/v1/trajectories/${encodeURIComponent(id)}${rest}`;

export async function trajectoryPage(root, ctx) {
  const id = ctx.params[0];
  const job = ctx.query.get("job");
  const view = new TrajectoryView(root, ctx, id, job);
  await ctx.every(POLL_MS, () => view.poll());
}

class TrajectoryView {
  constructor(root, ctx, id, job) {
    this.ctx = ctx;
    this.id = id;
    this.shown = null; // the info drawn (its JSON)
    this.expanded = new Set(); // step numbers whose output is open
    this.all = false; // every step drawn, not the first STEPS_SHOWN
    this.state = h("span", { id: "traj-state" });
    this.verdict = h("span", { id: "traj-verdict-badge" });
    this.info = h("div", { id: "traj-info" });
    this.verification = h("div", { id: "traj-verification" });
    this.steps = h("div", { id: "traj-steps" });
    this.recordText = h("pre", { class: "json", id: "traj-record-json" });
    const record = h("details", { id: "traj-record" }, h("summary", {}, "the record: what it takes to run it again (JSON)"), this.recordText);
    // Its text is made when it is opened (a long rollout's record is long).
    record.addEventListener("toggle", () => this.showRecord());
    this.record = record;
    const back = job ? h("a", { href: jobHash(job), class: "back" }, `‹ Job ${job}`) : h("a", { href: "#/jobs", class: "back" }, "‹ Jobs");
    root.append(
      back,
      pageHead(h("span", { class: "mono", id: "traj-id" }, id), this.state, this.verdict),
      h(
        "div",
        { class: "stack" },
        h("div", { class: "grid grid-2" }, card("Trajectory", {}, this.info), card("Verification", {}, this.verification)),
        card("Steps", { wide: true }, this.steps),
        card("Record", { wide: true }, record),
      ),
    );
  }

  /** Its steps, and what each asked (the record's actions): beside each other. */
  stepsAndRecord() {
    return Promise.allSettled([api(trajectoryPath(this.id, "/steps")), api(trajectoryPath(this.id, "/record"))]);
  }

  async poll() {
    const early = this.stepList ? null : this.stepsAndRecord(); // the first time: beside the trajectory
    const info = await api(trajectoryPath(this.id));
    if (!this.ctx.alive) return;
    const text = JSON.stringify(info);
    if (text === this.shown) return;
    this.state.replaceChildren(h("span", { class: `badge traj-${info.state}` }, info.state));
    this.verdict.replaceChildren(info.verification ? verdictBadge(info.verification) : "");
    fill(this.info, infoFacts(info));
    fill(this.verification, verification(info.verification));
    const [steps, record] = await (early || this.stepsAndRecord());
    if (!this.ctx.alive) return;
    if (steps.status === "rejected") throw steps.reason; // asked again at the next poll
    this.shown = text;
    this.stepList = steps.value.steps;
    this.actions = record.status === "fulfilled" ? record.value.actions : [];
    this.recordAnswer = record;
    this.recordText.textContent = "";
    this.showRecord();
    this.drawSteps();
  }

  showRecord() {
    const r = this.recordAnswer;
    if (!this.record.open || !r || this.recordText.textContent) return;
    this.recordText.textContent = r.status === "fulfilled" ? JSON.stringify(r.value, null, 2) : `no record: ${errorText(r.reason)}`;
  }

  drawSteps() {
    const all = this.stepList;
    const rows = this.all ? all : all.slice(0, STEPS_SHOWN);
    const body = table(
      [
        { title: "step", class: "num", cell: (s) => String(s.step) },
        { title: "kind", cell: (s) => h("span", { class: "step-kind" }, s.kind) },
        { title: "action", class: "mono small", cell: (s) => cut(actionLine(this.actions[s.step], s), 160) },
        { title: "result", class: "mono small", cell: (s) => cut(resultLine(s), 160) },
        { title: "duration", class: "num", cell: (s) => `${fmtNumber(s.duration, 2)} s` },
        { title: "exit", class: "num", cell: (s) => (s.exec ? String(s.exec.exit_code) : "") },
        { title: "cause", cell: (s) => (s.cause ? causeBadge(s.cause) : "") },
      ],
      rows,
      {
        id: "steps-table",
        empty: "no steps yet",
        rowAttrs: (s) => ({ class: "step-row", dataset: { step: String(s.step), kind: s.kind }, onclick: (e) => this.toggle(e, s) }),
      },
    );
    const more =
      all.length > rows.length &&
      h("p", { class: "note" }, `the first ${rows.length} of ${all.length} steps `, h("button", { type: "button", id: "steps-all", onclick: () => ((this.all = true), this.drawSteps()) }, "Show all"));
    fill(this.steps, note("A click on a step shows its whole output."), body, more);
    const byStep = new Map(rows.map((s) => [s.step, s]));
    for (const tr of this.steps.querySelectorAll("tr.step-row")) {
      const s = byStep.get(Number(tr.dataset.step));
      if (this.expanded.has(s.step)) tr.after(detailRow(tr, s, this.actions[s.step]));
    }
  }

  /** A click on a step's row: its output below it, or away again. */
  toggle(event, s) {
    if (event.target.closest("a, button")) return;
    const tr = event.currentTarget;
    const open = tr.nextElementSibling?.classList.contains("step-detail");
    if (open) {
      tr.nextElementSibling.remove();
      this.expanded.delete(s.step);
    } else {
      tr.after(detailRow(tr, s, this.actions[s.step]));
      this.expanded.add(s.step);
    }
  }
}

const errorText = (err) => (err instanceof ApiError ? `${err.code}: ${err.message}` : String(err?.message || err));

/** What a step asked, on one line: the command, the path, the checkpoint. */
function actionLine(action, s) {
  if (!action) return "";
  switch (action.kind) {
    case "exec": {
      const c = action.exec?.command;
      return `$ ${Array.isArray(c) ? c.join(" ") : c}`;
    }
    case "write":
    case "read":
      return action.path;
    case "rollback":
      return `to ${action.checkpoint_id}`;
    default:
      return s.kind;
  }
}

const firstLine = (text) => (text || "").split("\n").find((l) => l.trim()) || "";

/** How a step ended, on one line: its error, or its command's exit and first line of output. */
function resultLine(s) {
  if (s.error) return `${s.error.code}: ${s.error.message}`;
  if (s.exec) {
    const x = s.exec;
    const flags = [x.timed_out && "timed out", x.oom_killed && "OOM killed", x.signal && `signal ${x.signal}`].filter(Boolean);
    const out = x.encoding === "base64" ? "(binary output)" : firstLine(x.stdout) || firstLine(x.stderr);
    return [`exit ${x.exit_code}`, ...flags, out].filter(Boolean).join(" · ");
  }
  if (s.file) return `${s.file.path} (${fmtBytes(s.file.size)})`;
  if (s.content != null) return `${s.content.length} characters${s.encoding === "base64" ? " of base64" : ""}`;
  return s.snapshot_id || s.checkpoint_id || "ok";
}

/** The row under a step: its action and whole result. */
function detailRow(tr, s, action) {
  const parts = [];
  if (action) parts.push(h("h4", {}, "action"), h("pre", { class: "json" }, JSON.stringify(action, null, 2)));
  if (s.error) parts.push(h("h4", {}, "error"), h("pre", { class: "json step-error" }, `${s.error.code} (${s.error.cause || "?"}): ${s.error.message}`));
  if (s.exec) {
    const x = s.exec;
    parts.push(
      h("h4", {}, `stdout${x.stdout_truncated ? " (truncated)" : ""}`),
      h("pre", { class: "json step-stdout" }, x.stdout || ""),
      h("h4", {}, `stderr${x.stderr_truncated ? " (truncated)" : ""}`),
      h("pre", { class: "json step-stderr" }, x.stderr || ""),
    );
  }
  if (s.content != null) parts.push(h("h4", {}, `content (${s.encoding})`), h("pre", { class: "json" }, s.content));
  parts.push(h("h4", {}, "result"), h("pre", { class: "json" }, JSON.stringify({ ...s, exec: s.exec && { ...s.exec, stdout: undefined, stderr: undefined }, content: undefined }, null, 2)));
  return h("tr", { class: "step-detail", dataset: { step: String(s.step) } }, h("td", { colspan: String(tr.children.length) }, parts));
}

function infoFacts(t) {
  return facts([
    ["sandbox", t.sandbox_id ? h("a", { href: sandboxHash(t.sandbox_id), class: "mono sb-link", id: "traj-sandbox" }, t.sandbox_id) : "–"],
    ["steps", h("span", { id: "traj-steps-count" }, String(t.steps))],
    ["failed steps", countChips(t.failures, { cls: (c) => `cause-${c}` })],
    ["reward", h("span", { id: "traj-reward" }, fmtNumber(t.reward))],
    t.seed != null && ["seed", String(t.seed)],
    ["labels", labelChips(t.labels)],
    Object.keys(t.metadata || {}).length && ["metadata", labelChips(t.metadata)],
    t.source_snapshot && ["from snapshot", h("code", {}, t.source_snapshot)],
    ["created", timeCell(t.created_at)],
    t.closed_at && ["closed", timeCell(t.closed_at)],
    t.lost_from != null && ["log damaged", h("span", { class: "bad" }, `from step ${t.lost_from} on (those answer data_loss)`)],
  ]);
}

function verification(v) {
  if (!v) return note("Not verified.");
  const dropped = new Set(v.dropped || []);
  return [
    facts([
      ["verdict", verdictBadge(v)],
      ["reward", fmtNumber(v.reward)],
      v.cause && ["cause", causeBadge(v.cause)],
      ["took", `${fmtNumber(v.duration, 2)} s${v.queued ? ` (+${fmtNumber(v.queued, 2)} s queued)` : ""}`],
      v.result && ["checks' exit", h("span", { id: "verify-exit" }, String(v.result.exit_code))],
      v.error && ["error", h("span", { class: "mono small" }, `${v.error.code}: ${v.error.message}`)],
      v.verifier_sandbox_id && ["verifier's sandbox", h("a", { href: sandboxHash(v.verifier_sandbox_id), class: "mono" }, v.verifier_sandbox_id)],
      v.changes_layer && ["agent's changes", h("code", { title: v.changes_layer }, v.changes_layer.replace(/^sha256:/, "").slice(0, 12))],
    ]),
    h("h3", {}, `changed files (${v.changed.length})`),
    table(
      [
        { title: "path", class: "mono small", cell: (c) => c.path },
        { title: "change", cell: (c) => c.change },
        { title: "type", cell: (c) => c.type },
        { title: "", cell: (c) => (dropped.has(c.path) ? h("span", { class: "badge badge-warn" }, "dropped") : "") },
      ],
      v.changed,
      { id: "changed-table", empty: "nothing changed", rowAttrs: (c) => ({ dataset: { path: c.path } }) },
    ),
    dropped.size > 0 && h("p", { class: "note", id: "dropped" }, "dropped (protected, or outside allow): ", h("span", { class: "mono small" }, [...dropped].join(", "))),
    v.result && h("h3", {}, "the checks' output"),
    v.result && h("pre", { class: "json", id: "verify-stdout" }, v.result.stdout || "(no stdout)"),
    v.result && v.result.stderr && h("pre", { class: "json", id: "verify-stderr" }, v.result.stderr),
  ];
}
