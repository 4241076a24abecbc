// The daemon's JSON API as the console calls it: the token, requests, errors, the terminal socket.

const TOKEN_KEY = "sandfleet.token";

export const session = {
  get token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  },
  set token(value) {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  },
};

/** An answer other than 2xx: the API's `{"error": {code, message, retryable}}`, or the bare status. */
export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && typeof body === "object" && (body.error || body)) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || `http_${status}`;
    this.retryable = Boolean(err.retryable);
  }
}

const unauthenticatedListeners = new Set();

/** `fn(error)` on every 401: the console asks for a token again. */
export function onUnauthenticated(fn) {
  unauthenticatedListeners.add(fn);
}

/** `?a=1&label=x&label=y` from an object (arrays repeat, empty values are left out). */
export function queryString(query) {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(query || {})) {
    for (const v of Array.isArray(value) ? value : [value]) {
      if (v !== undefined && v !== null && v !== "") params.append(key, String(v));
    }
  }
  const text = params.toString();
  return text ? `?${text}` : "";
}

let signingIn = null; // while the sign-in call is in flight: it (see `whileSigningIn`)

/**
 * A page's calls go out while the sign-in call (`whoami`) is still in flight, beside it, not after
 * it; but they resolve only once it has (the page draws knowing who it is: read-only or not) and
 * reject with its error if it failed.
 */
export function whileSigningIn(promise) {
  signingIn = promise;
  const done = () => {
    if (signingIn === promise) signingIn = null;
  };
  promise.then(done, done);
}

/**
 * Call the API: `api("/v1/sandboxes", {query: {state: "all"}})`, `api(path, {method: "POST", body})`.
 * Resolves to the parsed JSON (or the Response itself with `raw: true`); rejects with an ApiError.
 */
export async function api(path, options = {}) {
  const waitFor = options.signIn ? null : signingIn;
  if (!waitFor) return call(path, options);
  const answer = call(path, options);
  answer.catch(() => {}); // its error is given below, after the sign-in's
  await waitFor;
  return answer;
}

async function call(path, { method = "GET", query, body, raw = false, signal } = {}) {
  const headers = {};
  if (session.token) headers.Authorization = `Bearer ${session.token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path + queryString(query), {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
    signal,
  });
  if (!res.ok) {
    const err = new ApiError(res.status, await res.json().catch(() => null));
    if (res.status === 401) unauthenticatedListeners.forEach((fn) => fn(err));
    throw err;
  }
  return raw ? res : res.json();
}

export const sandboxPath = (id, rest = "") => `/v1/sandboxes/${encodeURIComponent(id)}${rest}`;

/** One page of sandboxes: `{sandboxes, next, total}` (`next`: the cursor of the page after, or null). */
export async function listSandboxes({ labels = [], state, limit = 200, after } = {}) {
  const page = await api("/v1/sandboxes", { query: { label: labels, state, limit, after } });
  return {
    sandboxes: page.sandboxes,
    next: page.next ?? null,
    total: page.total ?? page.sandboxes.length,
  };
}

/** Who the token is: `{name, can_write, project}`. A daemon without /v1/whoami: a writer of unknown name. */
export async function whoami() {
  try {
    return await api("/v1/whoami", { signIn: true });
  } catch (err) {
    if (err.status !== 404) throw err;
    await api("/v1/health", { signIn: true }); // the token still has to be good
    return { name: session.token ? "token" : "anonymous", can_write: true, project: null };
  }
}

/** base64url of the UTF-8 bytes of `text`, without padding (a WebSocket subprotocol may carry it). */
function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** The terminal of a sandbox: a WebSocket whose subprotocols carry the token (a browser sends no headers). */
export function terminalSocket(sandboxId) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${scheme}//${location.host}${sandboxPath(sandboxId, "/terminal")}`;
  const protocols = ["sandfleet.terminal"];
  if (session.token) protocols.push(`sandfleet.bearer.${base64url(session.token)}`);
  const ws = new WebSocket(url, protocols);
  ws.binaryType = "arraybuffer";
  return ws;
}
