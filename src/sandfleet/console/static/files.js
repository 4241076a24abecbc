// A sandbox's files: directories to click through, small text files to read.

import { api, sandboxPath } from "./api.js";
import { fill, fmtBytes, h, note, showError, table, timeCell } from "./ui.js";

const VIEW_BYTES = 64 * 1024; // what a file view reads of a file

export class FileBrowser {
  constructor(host, sandboxId) {
    this.host = host;
    this.sandboxId = sandboxId;
    this.path = "/";
    this.crumbs = h("div", { class: "crumbs", id: "file-path" });
    this.listing = h("div", { class: "file-list" });
    this.viewer = h("div", { class: "file-viewer" });
    host.replaceChildren(this.crumbs, this.listing, this.viewer);
  }

  files(rest, query) {
    return api(sandboxPath(this.sandboxId, `/files/${rest}`), { query, raw: rest === "content" });
  }

  /** Show directory `path`. */
  async open(path) {
    try {
      const { files } = await this.files("list", { path });
      this.path = path;
      this.showCrumbs();
      this.showListing(sortEntries(files));
      this.viewer.replaceChildren();
    } catch (err) {
      showError(err);
    }
  }

  showCrumbs() {
    const parts = this.path.split("/").filter(Boolean);
    const links = [h("a", { href: "#", onclick: this.go("/") }, "/")];
    parts.forEach((part, i) => {
      const target = `/${parts.slice(0, i + 1).join("/")}`;
      links.push(h("a", { href: "#", onclick: this.go(target) }, part), i < parts.length - 1 ? "/" : "");
    });
    this.crumbs.replaceChildren(...links);
  }

  go(path) {
    return (event) => {
      event.preventDefault();
      this.open(path);
    };
  }

  showListing(entries) {
    const up = this.path === "/" ? [] : [{ name: "..", type: "dir", path: parentOf(this.path), up: true }];
    this.listing.replaceChildren(
      table(
        [
          { title: "name", cell: (f) => this.entryLink(f) },
          { title: "size", class: "num", cell: (f) => (f.up || f.type === "dir" ? "" : fmtBytes(f.size)) },
          { title: "mode", class: "mono", cell: (f) => (f.up ? "" : modeString(f)) },
          { title: "modified", cell: (f) => (f.up ? "" : timeCell(f.mtime)) },
        ],
        [...up, ...entries],
        { id: "files", empty: "empty directory" },
      ),
    );
  }

  entryLink(f) {
    const suffix = f.type === "dir" ? "/" : f.type === "symlink" ? ` → ${f.link_target || "?"}` : "";
    return h(
      "a",
      { href: "#", class: `file file-${f.type}`, dataset: { name: f.name }, onclick: (e) => (e.preventDefault(), this.choose(f)) },
      f.name,
      h("span", { class: "muted" }, suffix),
    );
  }

  async choose(f) {
    if (f.type === "dir") return this.open(f.path);
    if (f.type === "symlink") {
      try {
        const target = await this.files("stat", { path: f.path, follow_symlinks: true });
        return target.type === "dir" ? this.open(f.path) : this.view({ ...target, path: f.path, name: f.name });
      } catch (err) {
        return showError(err);
      }
    }
    if (f.type === "file") return this.view(f);
    this.viewer.replaceChildren(note(`${f.name}: not a regular file`));
  }

  /** Show the start of a file as text (a binary file is only named). */
  async view(f) {
    try {
      const res = await this.files("content", { path: f.path, length: VIEW_BYTES });
      const bytes = new Uint8Array(await res.arrayBuffer());
      const head = h("div", { class: "file-view-head" }, h("code", {}, f.path), h("span", { class: "muted" }, ` ${fmtBytes(f.size)}`));
      if (bytes.subarray(0, 8192).includes(0)) {
        this.viewer.replaceChildren(head, note("a binary file"));
        return;
      }
      const text = new TextDecoder("utf-8", { fatal: false }).decode(bytes);
      const cut = f.size > VIEW_BYTES ? note(`the first ${fmtBytes(VIEW_BYTES)} of ${fmtBytes(f.size)}`) : null;
      fill(this.viewer, head, h("pre", { class: "file-view", id: "file-view" }, text), cut);
    } catch (err) {
      showError(err);
    }
  }
}

function sortEntries(files) {
  const rank = (f) => (f.type === "dir" ? 0 : 1);
  return [...files].sort((a, b) => rank(a) - rank(b) || a.name.localeCompare(b.name));
}

function parentOf(path) {
  const parts = path.split("/").filter(Boolean);
  return `/${parts.slice(0, -1).join("/")}`;
}

/** "drwxr-xr-x" from a FileInfo's type and mode. */
function modeString(f) {
  const kind = { dir: "d", symlink: "l", file: "-" }[f.type] || "?";
  const bits = "rwxrwxrwx";
  let out = "";
  for (let i = 0; i < 9; i++) out += f.mode & (1 << (8 - i)) ? bits[i] : "-";
  return kind + out;
}
