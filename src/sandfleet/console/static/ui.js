// DOM helpers and formatting. Everything the API returns is put in the page as text, never as HTML.

/** `h("a", {href, class: "x", onclick}, "text", child, [more])`: an element. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  el.append(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

/** Replace `el`'s children (null, undefined and false are left out). */
export function fill(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

// -- formatting ----------------------------------------------------------------------------------

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

/** 1536 -> "1.5 KiB"; a string ("4GiB", as a spec may carry it) is shown as given. */
export function fmtBytes(n) {
  if (typeof n === "string") return n;
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  let i = 0;
  while (Math.abs(n) >= 1024 && i < UNITS.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)} ${UNITS[i]}`;
}

const pad = (n) => String(n).padStart(2, "0");

/** Seconds since the epoch -> "2025-01-31 14:02:09" (local time). */
export function fmtTime(ts) {
  if (typeof ts !== "number") return "–";
  const d = new Date(ts * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** Seconds since the epoch -> "3 min ago". */
export function fmtAgo(ts) {
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "none";
  if (s < 120) return `${s} s`;
  if (s < 7200) return `${+(s / 60).toFixed(1)} min`;
  return `${+(s / 3600).toFixed(1)} h`;
}

export const fmtCores = (n) => (typeof n === "number" ? `${+n.toFixed(2)}` : "–");

/** A time cell: the local time, its age on hover. */
export const timeCell = (ts) => h("time", { title: typeof ts === "number" ? fmtAgo(ts) : "" }, fmtTime(ts));

/** An age cell: "3 min ago", the local time on hover. */
export const agoCell = (ts) => h("time", { title: fmtTime(ts) }, typeof ts === "number" ? fmtAgo(ts) : "–");

/** 0.756 -> "76%"; null (nothing to divide) -> "–". */
export const fmtShare = (x) => (typeof x === "number" && Number.isFinite(x) ? `${Math.round(x * 100)}%` : "–");

/** A number as the API gives it, without float noise: 0.30000000000000004 -> "0.3". */
export const fmtNumber = (n, digits = 3) => (typeof n === "number" ? `${+n.toFixed(digits)}` : "–");

// -- small components ------------------------------------------------------------------------------

export const stateBadge = (state) => h("span", { class: `badge state state-${state}` }, state);

export function labelChips(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return h("span", { class: "muted" }, "–");
  return h(
    "span",
    { class: "chips" },
    entries.map(([k, v]) => h("span", { class: "chip", title: `${k}=${v}` }, `${k}=${v}`)),
  );
}

/** A bar of `used` against `limit` (none: no bar), its text beside it. */
export function meter(used, limit, text, { id } = {}) {
  const share = typeof limit === "number" && limit > 0 ? Math.min(1, used / limit) : null;
  return h(
    "div",
    { class: "meter-row", id, title: share === null ? "no limit" : `${Math.round(share * 100)}%` },
    h("div", { class: `meter${share === null ? " meter-none" : ""}` }, share === null ? null : h("div", { class: `meter-fill${share >= 1 ? " meter-full" : ""}`, style: `width: ${share * 100}%` })),
    h("span", { class: "meter-text" }, text),
  );
}

/** Counts by name (`{agent: 3, timeout: 1}`) as chips, the largest first; none: a dash. */
export function countChips(counts, { cls } = {}) {
  const entries = Object.entries(counts || {}).filter(([, n]) => n);
  if (!entries.length) return h("span", { class: "muted" }, "–");
  entries.sort((a, b) => b[1] - a[1]);
  return h("span", { class: "chips" }, entries.map(([k, n]) => h("span", { class: `chip ${cls ? cls(k) : ""}`, dataset: { name: k } }, `${k} ${n}`)));
}

/** A section with a title (and optional tools at its right). */
export function card(title, { tools = [], id, wide = false } = {}, ...body) {
  return h(
    "section",
    { class: wide ? "card card-wide" : "card", id },
    h("div", { class: "card-head" }, h("h2", {}, title), h("div", { class: "card-tools" }, tools)),
    body,
  );
}

const FIRST_ROWS = 50; // a long table's rows drawn at once (a screenful); the rest after that frame

/**
 * A table: `columns` of `{title, cell: (row) => node|text, class?}`. Of a long one, the first rows
 * are drawn with it and the others once that frame is painted (if the table is still shown).
 */
export function table(columns, rows, { empty = "nothing here", id, rowAttrs } = {}) {
  const head = h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.class }, c.title))));
  const tr = (row) => h("tr", rowAttrs ? rowAttrs(row) : {}, columns.map((c) => h("td", { class: c.class }, c.cell(row))));
  const body = h(
    "tbody",
    {},
    rows.length
      ? rows.slice(0, FIRST_ROWS).map(tr)
      : h("tr", {}, h("td", { class: "empty", colspan: String(columns.length) }, empty)),
  );
  if (rows.length > FIRST_ROWS) {
    requestAnimationFrame(() =>
      setTimeout(() => {
        if (body.isConnected) body.append(...rows.slice(FIRST_ROWS).map(tr));
      }),
    );
  }
  return h("div", { class: "table-wrap" }, h("table", { class: "data", id }, head, body));
}

/** A definition list of `[term, value]` pairs. */
export const facts = (pairs) =>
  h(
    "dl",
    { class: "facts" },
    pairs.filter(Boolean).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "–")]),
  );

export const note = (text, cls = "") => h("p", { class: `note ${cls}` }, text);

export const pageHead = (title, ...rest) => h("div", { class: "page-head" }, h("h1", {}, title), rest);

// -- banners ---------------------------------------------------------------------------------------

/** Show an API error (or any Error) in the #error banner: `code: message`. */
export function showError(err) {
  const banner = document.getElementById("error");
  const code = err && err.code ? `${err.code}: ` : "";
  document.getElementById("error-text").textContent = `${code}${(err && err.message) || err}`;
  banner.hidden = false;
}

export function clearError() {
  document.getElementById("error").hidden = true;
}

let noticeTimer;

/** A passing note of what an action did. */
export function notify(text) {
  const el = document.getElementById("notice");
  el.textContent = text;
  el.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => (el.hidden = true), 6000);
}

// -- action buttons --------------------------------------------------------------------------------

/**
 * A button that acts (pause, stop, ...): disabled for a read-only token whatever else happens to it;
 * busy while `run` is in flight; its error goes to the banner. `confirm`: a first click arms it (its
 * label becomes the question), a second within 4 s acts.
 */
export function actionButton(ctx, label, run, { danger = false, confirm, id, title } = {}) {
  const btn = h("button", {
    type: "button",
    id,
    class: `action${danger ? " danger" : ""}`,
    title: ctx.canWrite ? title : "read-only token",
    dataset: { readonly: ctx.canWrite ? "" : "1" },
  }, label);
  btn.disabled = !ctx.canWrite;
  let armed = null;
  btn.addEventListener("click", async () => {
    if (confirm && !armed) {
      btn.textContent = confirm;
      btn.classList.add("armed");
      armed = setTimeout(() => disarm(), 4000);
      return;
    }
    disarm();
    btn.classList.add("busy");
    btn.disabled = true;
    try {
      await run();
    } catch (err) {
      showError(err);
    } finally {
      btn.classList.remove("busy");
      btn.disabled = btn.dataset.readonly === "1" || btn.dataset.off === "1";
    }
  });
  function disarm() {
    clearTimeout(armed);
    armed = null;
    btn.textContent = label;
    btn.classList.remove("armed");
  }
  return btn;
}

/** Enable or disable an action button by state; a read-only token's stay disabled. */
export function setEnabled(btn, enabled) {
  btn.dataset.off = enabled ? "" : "1";
  if (!btn.classList.contains("busy")) btn.disabled = !enabled || btn.dataset.readonly === "1";
}
