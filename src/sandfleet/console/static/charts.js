// Lines over time (uPlot), for figures the daemon counts in buckets: one chart per figure, its lines
// fixed when it is made (a line with no data is drawn at 0, so the legend never reshuffles). uPlot
// must be loaded first (libs.js loadUplot).

const AXIS = { stroke: "#8b96a5", grid: { stroke: "#222a35", width: 1 }, ticks: { stroke: "#222a35" } };
const HEIGHT = 170;

const pad = (n) => String(n).padStart(2, "0");
const clock = (t, seconds = false) => {
  const d = new Date(t * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}${seconds ? `:${pad(d.getSeconds())}` : ""}`;
};
// Ticks less than a minute apart say their seconds (else a few minutes' ticks read "12:01 12:01").
const ticksText = (u, ticks) => ticks.map((t) => clock(t, ticks.length > 1 && ticks[1] - ticks[0] < 60));

const SPAN = 300; // seconds the x axis covers at least (a job's first points do not spread over the width)

export class LineChart {
  /** `lines`: [{label, stroke}]; `unit`: the y axis' label; `digits`: of the values in the legend. */
  constructor(host, { lines, unit, digits = 2 }) {
    this.host = host;
    const value = (u, v) => (v == null ? "–" : `${+v.toFixed(digits)}`);
    const options = {
      ...this.size(),
      cursor: { drag: { x: false, y: false } },
      legend: { live: true },
      scales: {
        x: {
          time: true,
          // From the data itself: given one point, uPlot asks for a day after it.
          range: (u) => {
            const xs = u.data[0];
            const end = xs.length ? xs[xs.length - 1] : Date.now() / 1000;
            return [Math.min(xs.length ? xs[0] : end, end - SPAN), end];
          },
        },
        y: { range: (u, min, max) => [0, Math.max(1, (max || 0) * 1.15)] },
      },
      series: [
        { value: (u, v) => (v == null ? "–" : clock(v, true)) },
        ...lines.map((l) => ({ label: l.label, stroke: l.stroke, width: 1.5, value })),
      ],
      axes: [
        { ...AXIS, space: 60, values: ticksText },
        { ...AXIS, label: unit, labelSize: 18, size: 46, values: (u, ticks) => ticks.map((t) => `${+t.toFixed(2)}`) },
      ],
    };
    this.plot = new window.uPlot(options, [[], ...lines.map(() => [])], host);
    this.resizeObserver = new ResizeObserver(() => this.plot.setSize(this.size()));
    this.resizeObserver.observe(host);
  }

  size() {
    return { width: Math.max(200, this.host.clientWidth), height: HEIGHT };
  }

  /** `times`: the x values (seconds since the epoch); `columns`: one array of y values per line. */
  set(times, columns) {
    this.plot.setData([times, ...columns]);
  }

  destroy() {
    this.resizeObserver.disconnect();
    this.plot.destroy();
  }
}
