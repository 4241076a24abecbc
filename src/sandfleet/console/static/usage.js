// A sandbox's CPU and memory over time (uPlot), from samples of GET /v1/sandboxes/{id}/usage.

const KEEP = 300; // samples kept: 10 minutes at one every 2 s
const MiB = 1024 * 1024;
const AXIS = { stroke: "#8b96a5", grid: { stroke: "#222a35", width: 1 }, ticks: { stroke: "#222a35" } };

const pad = (n) => String(n).padStart(2, "0");
const clock = (t) => {
  const d = new Date(t * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
};

export class UsageChart {
  constructor(host) {
    this.host = host;
    this.times = [];
    this.cpu = []; // cores: the CPU seconds used between two samples per second
    this.memory = []; // MiB
    this.last = null; // the previous sample: {t, cpu_seconds}
    this.plot = new window.uPlot(this.options(), [this.times, this.cpu, this.memory], host);
    this.resizeObserver = new ResizeObserver(() => this.plot.setSize(this.size()));
    this.resizeObserver.observe(host);
  }

  size() {
    return { width: Math.max(200, this.host.clientWidth), height: 220 };
  }

  options() {
    const upTo = (floor) => (u, min, max) => [0, Math.max(floor, (max || 0) * 1.2)];
    const fixed = (digits) => (u, ticks) => ticks.map((t) => `${+t.toFixed(digits)}`);
    return {
      ...this.size(),
      cursor: { drag: { x: false, y: false } },
      legend: { live: true },
      scales: {
        // at least the last 30 s, so the first samples do not spread over the whole width
        x: { time: true, range: (u, min, max) => (max == null ? [0, 1] : [Math.min(min, max - 30), max]) },
        cores: { range: upTo(0.1) },
        mib: { range: upTo(1) },
      },
      series: [
        { value: (u, v) => (v == null ? "–" : clock(v)) },
        {
          label: "CPU",
          scale: "cores",
          stroke: "#5aa9ff",
          fill: "rgba(90,169,255,0.12)",
          width: 2,
          value: (u, v) => (v == null ? "–" : `${v.toFixed(2)} cores`),
        },
        {
          label: "memory",
          scale: "mib",
          stroke: "#e3a35e",
          width: 2,
          value: (u, v) => (v == null ? "–" : `${v.toFixed(1)} MiB`),
        },
      ],
      axes: [
        { ...AXIS, space: 60, incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600], values: (u, ticks) => ticks.map(clock) },
        { ...AXIS, scale: "cores", label: "cores", labelSize: 18, size: 44, values: fixed(2) },
        { ...AXIS, scale: "mib", label: "MiB", labelSize: 18, side: 1, size: 50, grid: { show: false }, values: fixed(1) },
      ],
    };
  }

  /** One sample: `usage` as the API gives it, read at `t` (seconds since the epoch). */
  push(usage, t = Date.now() / 1000) {
    const cores = this.last ? Math.max(0, (usage.cpu_seconds - this.last.cpu_seconds) / (t - this.last.t)) : null;
    this.last = { t, cpu_seconds: usage.cpu_seconds };
    this.times.push(t);
    this.cpu.push(cores);
    this.memory.push(usage.memory_bytes / MiB);
    if (this.times.length > KEEP) [this.times, this.cpu, this.memory].forEach((a) => a.shift());
    this.plot.setData([this.times, this.cpu, this.memory]);
  }

  destroy() {
    this.resizeObserver.disconnect();
    this.plot.destroy();
  }
}
