// #/sandboxes/<id> : one sandbox: its terminal, usage over time, spec, files and events; pause,
// resume, stop. Its state, usage and new events are read every 2 s while the page is shown. The
// terminal's and the chart's libraries are loaded as the page starts (no other page needs them); the
// head and the spec are drawn without waiting for them.

import { ApiError, api, sandboxPath } from "../api.js";
import { FileBrowser } from "../files.js";
import { loadUplot, loadXterm } from "../libs.js";
import { TerminalView } from "../terminal.js";
import {
  actionButton,
  card,
  facts,
  fmtBytes,
  fmtCores,
  fmtSeconds,
  h,
  labelChips,
  note,
  notify,
  pageHead,
  setEnabled,
  showError,
  stateBadge,
  table,
  timeCell,
} from "../ui.js";
import { UsageChart } from "../usage.js";
import { imageOf } from "./sandboxes.js";

const POLL_MS = 2000;
const EVENTS_SHOWN = 300;
const GONE = new Set(["stopped", "failed"]);

export async function sandboxPage(root, ctx) {
  const id = ctx.params[0];
  // Fetched beside the sandbox's info; a read-only token (once known) opens no terminal.
  const libs = { uplot: loadUplot(), xterm: ctx.me && !ctx.canWrite ? null : loadXterm() };
  Object.values(libs).forEach((p) => p?.catch(() => {})); // their errors are shown where they are used
  const info = await api(sandboxPath(id));
  if (!ctx.alive) return;
  const page = new SandboxView(root, ctx, info, libs);
  ctx.onCleanup(() => page.dispose());
  await ctx.every(POLL_MS, () => page.poll());
}

class SandboxView {
  constructor(root, ctx, info, libs) {
    this.ctx = ctx;
    this.id = info.id;
    this.info = info;
    this.libs = libs;
    this.fresh = true; // `info` was just read: the first poll does not read it again
    this.events = [];
    this.lastSeq = 0;
    this.gone = false;

    this.badge = h("span", { id: "sb-state" });
    this.subtitle = h("p", { class: "subtitle muted", id: "sb-subtitle" });
    this.buttons = this.actionButtons();
    root.append(
      h("a", { href: "#/sandboxes", class: "back" }, "‹ Sandboxes"),
      pageHead(h("span", { class: "mono", id: "sb-id" }, this.id), this.badge, h("div", { class: "head-actions" }, Object.values(this.buttons))),
      this.subtitle,
      this.terminalCard(),
      h("div", { class: "grid grid-2" }, this.usageCard(), this.specCard(), this.filesCard(), this.eventsCard()),
    );
    this.show(info);
    this.startTerminal().catch(showError);
    this.startFiles();
  }

  // -- state and actions -----------------------------------------------------------------------------

  actionButtons() {
    return {
      pause: actionButton(this.ctx, "Pause", () => this.pause(), {
        id: "btn-pause",
        title: "freeze it and push its memory out (closes the terminal)",
      }),
      resume: actionButton(this.ctx, "Resume", () => this.resume(), { id: "btn-resume" }),
      stop: actionButton(this.ctx, "Stop", () => this.stop(), { id: "btn-stop", danger: true, confirm: "Really stop?" }),
    };
  }

  /** The node pauses no sandbox with a request in flight, and an open terminal is one: it is closed first. */
  async pause() {
    this.reconnect = Boolean(this.terminal?.connected);
    if (this.reconnect) await this.terminal.disconnect();
    for (let attempt = 0; ; attempt++) {
      try {
        this.show(await api(sandboxPath(this.id, "/pause"), { method: "POST" }));
        break;
      } catch (err) {
        // The terminal's end may take the node a moment to see.
        if (!(err instanceof ApiError && err.code === "wrong_state" && this.reconnect && attempt < 10)) throw err;
        await new Promise((resolve) => setTimeout(resolve, 300));
      }
    }
    notify(`paused ${this.id}`);
  }

  async resume() {
    this.show(await api(sandboxPath(this.id, "/resume"), { method: "POST" }));
    notify(`resumed ${this.id}`);
    if (this.reconnect) this.terminal.connect();
    this.reconnect = false;
  }

  async stop() {
    if (this.terminal?.connected) await this.terminal.disconnect(); // else it reports the stop as an error
    const info = await api(sandboxPath(this.id), { method: "DELETE" });
    this.show(info);
    notify(`stopped ${this.id}`);
  }

  /** The sandbox as last read: the badge, the subtitle, which actions apply. */
  show(info) {
    this.info = info;
    this.badge.replaceChildren(stateBadge(info.state));
    const s = info.spec;
    this.subtitle.textContent =
      `${imageOf(s)} · ${s.backend} · ${fmtCores(s.resources?.cpu)} cores, ${fmtBytes(s.resources?.memory)}` +
      (info.stop_reason ? ` · stopped: ${info.stop_reason}` : "");
    setEnabled(this.buttons.pause, info.state === "running");
    setEnabled(this.buttons.resume, info.state === "paused");
    setEnabled(this.buttons.stop, !GONE.has(info.state));
    if (GONE.has(info.state)) this.terminal?.disconnect();
  }

  /** Every 2 s: its state, its usage, new events. A sandbox no longer there stops the polling. */
  async poll() {
    if (this.gone) return;
    try {
      if (!this.fresh) this.show(await api(sandboxPath(this.id)));
      this.fresh = false;
    } catch (err) {
      if (!(err instanceof ApiError && err.code === "not_found")) throw err;
      this.gone = true;
      this.show({ ...this.info, state: GONE.has(this.info.state) ? this.info.state : "stopped" });
      this.usageNote.textContent = "the sandbox is gone (stopped and forgotten by the node)";
      return;
    }
    await Promise.all([this.pollUsage(), this.pollEvents()]);
  }

  // -- terminal --------------------------------------------------------------------------------------

  terminalCard() {
    this.termStatus = h("span", { id: "term-status", class: "muted" }, "not connected");
    this.connectButton = h("button", { type: "button", id: "term-connect", onclick: () => this.connectTerminal() }, "Connect");
    this.termHost = h("div", { class: "term-host", id: "terminal" });
    return card("Terminal", { wide: true, tools: [this.termStatus, this.connectButton] }, this.termHost);
  }

  connectTerminal() {
    if (this.terminal) this.terminal.connect();
    else this.startTerminal().catch(showError);
  }

  async startTerminal() {
    if (!this.ctx.canWrite) {
      this.connectButton.disabled = true;
      this.connectButton.title = "read-only token";
      this.termHost.replaceWith(note("A read-only token opens no terminal."));
      return;
    }
    this.connectButton.disabled = true;
    this.termStatus.textContent = "loading the terminal…";
    try {
      await (this.libs.xterm ?? (this.libs.xterm = loadXterm()));
    } catch (err) {
      this.libs.xterm = null; // Connect tries again
      this.termStatus.textContent = `no terminal: ${err.message}`;
      this.connectButton.disabled = false;
      return;
    }
    if (!this.ctx.alive) return;
    this.connectButton.disabled = false;
    this.terminal = new TerminalView(this.termHost, this.id, {
      onStatus: (text, connected) => {
        this.termStatus.textContent = text;
        this.connectButton.disabled = connected;
        this.connectButton.textContent = "Connect";
      },
      onError: (err) => showError(err),
    });
    if (this.info.state === "running") this.terminal.connect();
    else this.termStatus.textContent = `not connected: the sandbox is ${this.info.state} (Connect resumes it)`;
  }

  // -- usage -----------------------------------------------------------------------------------------

  usageCard() {
    this.chartHost = h("div", { class: "chart", id: "usage-chart" });
    this.usageNote = h("p", { class: "note", id: "usage-note" });
    this.usageFacts = h("div", { id: "usage-now" });
    return card("Usage", {}, this.chartHost, this.usageNote, this.usageFacts);
  }

  async pollUsage() {
    if (GONE.has(this.info.state)) {
      this.usageNote.textContent = `no usage: the sandbox is ${this.info.state}`;
      return;
    }
    let u;
    try {
      u = await api(sandboxPath(this.id, "/usage"));
    } catch (err) {
      if (!(err instanceof ApiError && err.status < 500)) throw err;
      this.usageNote.textContent = `no usage: ${err.message}`;
      return;
    }
    this.usageFacts.replaceChildren(
      facts([
        ["memory", `${fmtBytes(u.memory_bytes)} (peak ${fmtBytes(u.memory_peak_bytes)})`],
        ["CPU time", `${u.cpu_seconds.toFixed(2)} s`],
        ["tasks", String(u.pids)],
        (u.oom_kills || u.pids_limit_hits) && ["limits hit", `${u.oom_kills} OOM kills, ${u.pids_limit_hits} at the pids limit`],
      ]),
    );
    let noChart = "";
    if (!this.chart) {
      try {
        await this.libs.uplot;
      } catch (err) {
        noChart = `no chart: ${err.message}`;
        this.libs.uplot = loadUplot(); // tried again at the next poll
        this.libs.uplot.catch(() => {});
      }
      if (!this.ctx.alive) return;
      if (!noChart) this.chart = new UsageChart(this.chartHost);
    }
    this.chart?.push(u);
    this.usageNote.textContent = noChart;
  }

  // -- spec ------------------------------------------------------------------------------------------

  specCard() {
    const s = this.info.spec;
    const r = s.resources || {};
    const net = s.network && typeof s.network === "object" ? JSON.stringify(s.network) : String(s.network ?? "none");
    return card(
      "Spec",
      {},
      facts([
        ["project", s.project || "–"],
        ["image", h("code", {}, s.image || "busybox")],
        s.layers?.length && ["layers", h("span", { class: "chips" }, s.layers.map((l) => h("code", { class: "chip" }, l)))],
        ["tier", s.backend],
        ["resources", `${fmtCores(r.cpu)} cores (request ${r.cpu_request ?? "default"}), ${fmtBytes(r.memory)}, disk ${fmtBytes(r.disk)}, ${r.pids} tasks`],
        ["user, workdir", `${s.user} in ${s.workdir}`],
        ["lifetimes", `idle ${fmtSeconds(s.idle_ttl)}, max ${fmtSeconds(s.max_lifetime)}, pause after ${fmtSeconds(s.pause_after)}`],
        ["network", h("code", {}, net)],
        ["labels", labelChips(s.labels)],
        ["env", Object.keys(s.env || {}).join(", ") || "–"],
        ["created", timeCell(this.info.created_at)],
        ["last active", timeCell(this.info.last_active_at)],
      ]),
      h("details", {}, h("summary", {}, "as JSON"), h("pre", { class: "json" }, JSON.stringify(this.info, null, 2))),
    );
  }

  // -- files -----------------------------------------------------------------------------------------

  filesCard() {
    this.filesHost = h("div", { id: "file-browser" });
    return card("Files", {}, this.filesHost);
  }

  startFiles() {
    const open = () => {
      this.files = new FileBrowser(this.filesHost, this.id);
      this.files.open(this.info.spec.workdir || "/");
    };
    if (this.info.state === "running") return open();
    // Reading files resumes a paused sandbox: only when asked.
    const why = this.info.state === "paused" ? "reading its files resumes it" : `it is ${this.info.state}`;
    this.filesHost.replaceChildren(note(`The sandbox is ${this.info.state}: ${why}.`), h("button", { type: "button", onclick: open }, "Show files"));
  }

  // -- events ----------------------------------------------------------------------------------------

  eventsCard() {
    this.eventsHost = h("div", { id: "events" });
    const audit = h("a", { href: `#/audit?sandbox=${encodeURIComponent(this.id)}` }, "its audit records");
    return card("Events", { tools: [audit] }, this.eventsHost);
  }

  async pollEvents() {
    let fresh = [];
    for (;;) {
      const { events } = await api(sandboxPath(this.id, "/events"), { query: { after: this.lastSeq, limit: 1000 } });
      fresh = fresh.concat(events);
      if (events.length) this.lastSeq = events[events.length - 1].seq;
      if (events.length < 1000) break;
    }
    if (!fresh.length && this.eventsHost.childElementCount) return;
    this.events = fresh.reverse().concat(this.events).slice(0, EVENTS_SHOWN);
    this.eventsHost.replaceChildren(
      table(
        [
          { title: "time", cell: (e) => timeCell(e.time) },
          { title: "event", cell: (e) => h("span", { class: "event-kind" }, e.kind) },
          { title: "", class: "mono small", cell: (e) => eventData(e.data) },
        ],
        this.events,
        { empty: "no events yet" },
      ),
    );
  }

  dispose() {
    this.terminal?.dispose();
    this.chart?.destroy();
  }
}

function eventData(data) {
  const value = (v) => (typeof v === "object" ? JSON.stringify(v) : String(v));
  const cut = (text) => (text.length > 160 ? `${text.slice(0, 160)}…` : text);
  return Object.entries(data || {})
    .map(([k, v]) => `${k}=${cut(value(v))}`)
    .join(" ");
}
