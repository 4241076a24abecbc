// A sandbox's terminal: xterm.js over the WebSocket /v1/sandboxes/{id}/terminal.
//
// client -> server: text {"type":"start","rows","cols"} first, then binary frames of keystrokes, and
// text {"type":"resize","rows","cols"}; server -> client: binary frames of output, text
// {"type":"started","pid"}, {"type":"exit","result"} or {"type":"error","error"} (then it closes).

import { terminalSocket } from "./api.js";

const THEME = {
  background: "#0b0f14",
  foreground: "#d7dde5",
  cursor: "#7cc4ff",
  selectionBackground: "#2d4a6b",
  black: "#1b2129",
  brightBlack: "#5c6773",
  blue: "#5aa9ff",
  brightBlue: "#8cc4ff",
  green: "#7fd18b",
  brightGreen: "#a3e6ad",
  red: "#ff7b72",
  brightRed: "#ffa198",
  yellow: "#e3c16f",
  brightYellow: "#f2d78c",
};

export class TerminalView {
  /** `onStatus(text, connected)`: the connection's state; `onError({code, message})`: what the server refused. */
  constructor(host, sandboxId, { onStatus = () => {}, onError = () => {} } = {}) {
    this.sandboxId = sandboxId;
    this.onStatus = onStatus;
    this.onError = onError;
    this.ws = null;
    this.encoder = new TextEncoder();
    this.term = new window.Terminal({
      cursorBlink: true,
      fontFamily: 'ui-monospace, "DejaVu Sans Mono", "Liberation Mono", Menlo, monospace',
      fontSize: 13,
      scrollback: 5000,
      theme: THEME,
    });
    this.fitAddon = new window.FitAddon.FitAddon();
    this.term.loadAddon(this.fitAddon);
    this.term.open(host);
    this.term.onData((data) => this.send(this.encoder.encode(data)));
    this.term.onBinary((data) => this.send(Uint8Array.from(data, (c) => c.charCodeAt(0) & 0xff)));
    this.resizeObserver = new ResizeObserver(() => this.fit());
    this.resizeObserver.observe(host);
    this.fit();
  }

  get connected() {
    return this.ws !== null && this.ws.readyState <= WebSocket.OPEN;
  }

  connect(options = {}) {
    if (this.connected) return;
    this.fit();
    const ws = (this.ws = terminalSocket(this.sandboxId));
    this.onStatus("connecting…", true);
    ws.addEventListener("open", () => {
      ws.send(JSON.stringify({ type: "start", rows: this.term.rows, cols: this.term.cols, ...options }));
      this.onStatus("starting…", true);
    });
    ws.addEventListener("message", (event) => {
      if (typeof event.data === "string") this.control(JSON.parse(event.data));
      else this.term.write(new Uint8Array(event.data));
    });
    ws.addEventListener("close", (event) => {
      if (this.ws !== ws) return;
      this.ws = null;
      const why = event.code === 1000 || event.code === 1005 ? "" : ` (code ${event.code}${event.reason ? `: ${event.reason}` : ""})`;
      this.onStatus(`disconnected${why}`, false);
    });
  }

  /** A text frame of the server's: started, exit, error. */
  control(msg) {
    if (msg.type === "started") {
      this.onStatus(`connected · pid ${msg.pid}`, true);
      this.term.focus();
    } else if (msg.type === "exit") {
      const code = msg.result ? msg.result.exit_code : "?";
      this.term.write(`\r\n\x1b[2m[exited with code ${code}]\x1b[0m\r\n`);
    } else if (msg.type === "error") {
      const err = msg.error || {};
      this.term.write(`\r\n\x1b[31m${err.code || "error"}: ${err.message || ""}\x1b[0m\r\n`);
      this.onError(err);
    }
  }

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(bytes);
  }

  /** Fit the terminal to its box; a size that changed is sent to the server. */
  fit() {
    const { rows, cols } = this.term;
    try {
      this.fitAddon.fit();
    } catch {
      return; // not laid out yet
    }
    if ((rows !== this.term.rows || cols !== this.term.cols) && this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: "resize", rows: this.term.rows, cols: this.term.cols }));
    }
  }

  /** Close the connection (what runs on the terminal ends); resolves once it is closed. */
  disconnect() {
    const ws = this.ws;
    if (!ws || ws.readyState === WebSocket.CLOSED) return Promise.resolve();
    const closed = new Promise((resolve) => ws.addEventListener("close", resolve, { once: true }));
    ws.close(1000);
    return closed;
  }

  dispose() {
    this.resizeObserver.disconnect();
    const ws = this.ws;
    this.ws = null;
    if (ws) ws.close(1000);
    this.term.dispose();
  }
}
