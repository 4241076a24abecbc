// #/images : the node's layer store (GET /v1/images): each image and the layers it stacks.

import { api } from "../api.js";
import { fmtBytes, h, pageHead, table, timeCell } from "../ui.js";

export async function imagesPage(root, ctx) {
  const body = h("div", { id: "images" });
  const summary = h("span", { class: "muted" });
  root.append(pageHead("Images", summary), body);
  const { images } = await api("/v1/images");
  if (!ctx.alive) return;
  images.sort((a, b) => `${a.name}:${a.tag}`.localeCompare(`${b.name}:${b.tag}`));
  summary.textContent = `${images.length} in the layer store`;
  body.replaceChildren(
    table(
      [
        { title: "image", cell: (i) => h("code", {}, `${i.name}:${i.tag}`) },
        { title: "size", class: "num", cell: (i) => fmtBytes(i.size) },
        { title: "created", cell: (i) => timeCell(i.created) },
        { title: "data", cell: (i) => (i.on_demand ? h("span", { class: "badge" }, "on demand") : "local") },
        { title: "layers (bottom → top)", cell: (i) => layers(i.layers) },
      ],
      images,
      { id: "images-table", empty: "no images" },
    ),
  );
}

function layers(digests) {
  if (!digests.length) return h("span", { class: "muted" }, "none");
  const short = (d) => h("code", { class: "chip", title: d }, d.replace(/^sha256:/, "").slice(0, 12));
  if (digests.length <= 3) return h("span", { class: "chips" }, digests.map(short));
  return h("details", {}, h("summary", {}, `${digests.length} layers`), h("span", { class: "chips" }, digests.map(short)));
}
