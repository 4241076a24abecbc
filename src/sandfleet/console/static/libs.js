// The vendored libraries (static/vendor/), loaded when a page first needs them: only the sandbox page
// does (its terminal: xterm.js and the fit addon; its usage chart: uPlot). They set globals (Terminal,
// FitAddon, uPlot). Each file is asked for once; a load that failed is tried again next time.
//
// The daemon adds `?v=<stamp>` to the paths below as it serves this file (the vendored files are then
// cached for good); without it they still load.

const XTERM = ["./vendor/xterm.css", "./vendor/xterm.js", "./vendor/addon-fit.js"];
const UPLOT = ["./vendor/uPlot.min.css", "./vendor/uPlot.iife.min.js"];

const loads = new Map(); // url -> Promise

/** Resolves once xterm.js and its fit addon are loaded (window.Terminal, window.FitAddon). */
export const loadXterm = () => Promise.all(XTERM.map(load));

/** Resolves once uPlot is loaded (window.uPlot). */
export const loadUplot = () => Promise.all(UPLOT.map(load));

function load(path) {
  const url = new URL(path, import.meta.url).href;
  let promise = loads.get(url);
  if (!promise) {
    promise = new Promise((resolve, reject) => {
      const css = /\.css(\?|$)/.test(url);
      const el = css ? document.createElement("link") : document.createElement("script");
      if (css) {
        el.rel = "stylesheet";
        el.href = url;
      } else {
        el.src = url;
        el.async = false; // in the order asked, as they arrive
      }
      el.onload = () => resolve();
      el.onerror = () => {
        loads.delete(url);
        el.remove();
        reject(new Error(`could not load ${url.replace(/\?.*/, "")}`));
      };
      // Stylesheets before the console's own (app.css styles xterm's and uPlot's elements too).
      const own = css && document.querySelector('link[rel="stylesheet"][href*="app.css"]');
      if (own) own.before(el);
      else document.head.append(el);
    });
    loads.set(url, promise);
  }
  return promise;
}
