// The console's entry: sign-in, the header, hash routing and each page's lifetime.

import { ApiError, api, onUnauthenticated, session, whileSigningIn, whoami } from "./api.js";
import { ALERTS_MS, alertsPage, showAlertCount } from "./pages/alerts.js";
import { auditPage } from "./pages/audit.js";
import { clusterPage } from "./pages/cluster.js";
import { imagesPage } from "./pages/images.js";
import { jobPage } from "./pages/job.js";
import { jobsPage } from "./pages/jobs.js";
import { nodePage } from "./pages/node.js";
import { sandboxPage } from "./pages/sandbox.js";
import { sandboxesPage } from "./pages/sandboxes.js";
import { trajectoryPage } from "./pages/trajectory.js";
import { clearError, h, showError } from "./ui.js";

// [pattern of the hash's path, nav entry, page]
const ROUTES = [
  [/^\/$/, "node", nodePage],
  [/^\/sandboxes$/, "sandboxes", sandboxesPage],
  [/^\/sandboxes\/([^/]+)$/, "sandboxes", sandboxPage],
  [/^\/jobs$/, "jobs", jobsPage],
  [/^\/jobs\/([^/]+)$/, "jobs", jobPage],
  [/^\/trajectories\/([^/]+)$/, "jobs", trajectoryPage],
  [/^\/images$/, "images", imagesPage],
  [/^\/audit$/, "audit", auditPage],
  [/^\/alerts$/, "alerts", alertsPage],
  [/^\/cluster$/, "cluster", clusterPage],
];

const $ = (id) => document.getElementById(id);
let me = null; // {name, can_write, project}
let signingIn = null; // the sign-in call, while it is in flight
let current = null; // the page shown: its context
let watching = null; // while signed in: the alerts poll's {timer}

// -- pages ----------------------------------------------------------------------------------------

/** `#/sandboxes?state=all` -> {path: "/sandboxes", query: URLSearchParams} (path segments still encoded). */
function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, qs = ""] = raw.split(/\?(.*)/s);
  return { path: path || "/", query: new URLSearchParams(qs) };
}

/**
 * What a page gets: its params, who we are, and timers and cleanups that end with it. A page starts
 * while the sign-in call may still be in flight: `me` and `canWrite` are known once any of its API
 * calls has answered (they wait for the sign-in).
 */
function pageContext(params, query) {
  const cleanups = [];
  const ctx = {
    params,
    query,
    get me() {
      return me;
    },
    get canWrite() {
      return Boolean(me && me.can_write);
    },
    alive: true,
    onCleanup: (fn) => cleanups.push(fn),
    /**
     * Run `fn` now (`{wait: true}`: in `ms`) and every `ms` after it finished, while the page is
     * shown; errors go to the banner.
     */
    every(ms, fn, { wait = false } = {}) {
      let timer;
      const tick = async () => {
        try {
          await fn();
        } catch (err) {
          if (ctx.alive && !(err instanceof ApiError && err.status === 401)) showError(err);
        }
        if (ctx.alive) timer = setTimeout(tick, ms);
      };
      cleanups.push(() => clearTimeout(timer));
      if (!wait) return tick();
      timer = setTimeout(tick, ms);
      return Promise.resolve();
    },
    close() {
      ctx.alive = false;
      cleanups.splice(0).forEach((fn) => fn());
    },
  };
  return ctx;
}

function leavePage() {
  if (current) current.close();
  current = null;
  $("app").replaceChildren();
}

async function route() {
  leavePage();
  clearError();
  if (!me && !signingIn) return;
  const { path, query } = parseHash();
  const match = ROUTES.map(([re, nav, page]) => [re.exec(path), nav, page]).find(([m]) => m);
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", match && a.dataset.route === match[1]);
  const root = $("app");
  if (!match) {
    root.append(h("p", { class: "note" }, "No such page. ", h("a", { href: "#/" }, "The node")));
    return;
  }
  const [m, , page] = match;
  const ctx = (current = pageContext(m.slice(1).map(decodeURIComponent), query));
  try {
    await page(root, ctx);
  } catch (err) {
    if (ctx.alive && !(err instanceof ApiError && err.status === 401)) showError(err);
  }
}

// -- who we are ------------------------------------------------------------------------------------

function showWhoami() {
  $("whoami").hidden = false;
  $("whoami-name").textContent = me.name;
  $("whoami-project").textContent = me.project ? `project ${me.project}` : "";
  $("readonly-badge").hidden = Boolean(me.can_write);
  $("logout").hidden = !session.token;
}

// -- what every page shows: the alerts' count, the cluster's entry ---------------------------------

/** Signed in: the alerts firing, counted in the top bar every 10 s; the Cluster entry if a gateway serves us. */
function watch() {
  unwatch();
  const w = (watching = { timer: null });
  const tick = async () => {
    try {
      showAlertCount((await api("/v1/alerts")).alerts);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) {
        $("nav-alerts").hidden = true; // a daemon older than alerts: no entry, and no more asking
        return;
      }
      if (watching === w && !(err instanceof ApiError && err.status === 401)) showError(err);
    }
    if (watching === w) w.timer = setTimeout(tick, ALERTS_MS);
  };
  tick();
  // Only a cluster gateway answers this (a node: 404); once per sign-in.
  api("/v1/cluster/nodes").then(
    () => watching === w && ($("nav-cluster").hidden = false),
    () => {},
  );
}

function unwatch() {
  if (watching) clearTimeout(watching.timer);
  watching = null;
  $("nav-cluster").hidden = true;
  $("nav-alerts").hidden = false;
  $("alerts-count").hidden = true;
}

function showLogin(message) {
  me = null;
  unwatch();
  leavePage();
  $("whoami").hidden = true;
  $("login").hidden = false;
  const msg = $("login-message");
  msg.textContent = message || "";
  msg.hidden = !message;
  $("token").value = "";
  $("token").focus();
}

/** Ask the daemon who the token is; the page of the hash starts meanwhile (its calls beside this one). */
async function start() {
  if (!session.token) return showLogin(""); // a TCP listener always wants one
  me = null;
  const signIn = (signingIn = whoami().then((who) => (me = who)));
  whileSigningIn(signIn);
  route();
  try {
    await signIn;
  } catch (err) {
    if (signingIn !== signIn) return; // a sign-in after this one
    signingIn = null;
    if (err instanceof ApiError && err.status === 401) {
      showLogin(`That token was refused: ${err.message}`);
    } else {
      showLogin(`The daemon could not be asked: ${err.message}`);
    }
    return;
  }
  if (signingIn !== signIn) return;
  signingIn = null;
  $("login").hidden = true;
  showWhoami();
  watch();
}

function boot() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    session.token = $("token").value.trim();
    start();
  });
  $("logout").addEventListener("click", () => {
    session.token = "";
    showLogin("Signed out.");
  });
  $("error-close").addEventListener("click", clearError);
  onUnauthenticated((err) => {
    if (me) showLogin(`Signed out by the daemon: ${err.message}`);
  });
  window.addEventListener("hashchange", route);
  start();
}

boot();
