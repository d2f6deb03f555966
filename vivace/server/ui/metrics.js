// The live panel: reads /metrics every second and charts requests running/waiting, KV cache
// usage, TTFT and ITL p50/p99 over the last minute (from histogram bucket deltas, as
// Prometheus' histogram_quantile does) and generated tokens per second.

import { TimeSeries } from "./charts.js";

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;
const WINDOW_MS = 60000;
const RATE_WINDOW_MS = 10000;

// Prometheus text exposition -> [{ name, labels, value }].
export function parsePrometheus(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(SAMPLE);
    if (!m) continue;
    const labels = {};
    for (const [, key, value] of (m[2] || "").matchAll(LABEL)) labels[key] = value;
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

// A series over all its label sets (a scaled-out server has one per replica): `combine` of
// their values, null when there is none.
function total(samples, name, combine = (a, b) => a + b) {
  const values = samples.filter((s) => s.name === name).map((s) => s.value);
  return values.length ? values.reduce(combine) : null;
}

// Requests running and waiting on every engine, and the fullest engine's KV cache use (0 to 1).
export function engineLoad(samples) {
  return {
    running: total(samples, "vivace:num_requests_running"),
    waiting: total(samples, "vivace:num_requests_waiting"),
    kv: total(samples, "vivace:kv_cache_usage_perc", (a, b) => Math.max(a, b)),
  };
}

// Cumulative buckets of a histogram summed over its label sets, [[upper bound, count], ...] by bound.
function buckets(samples, name) {
  const counts = new Map();
  for (const s of samples.filter((s) => s.name === `${name}_bucket`)) {
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    counts.set(le, (counts.get(le) || 0) + s.value);
  }
  return [...counts].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of cumulative `now` minus cumulative `before` (same bounds; the window starts
// when the page does, so what ended before it is not counted); null if the window is empty.
export function windowQuantile(now, before, q) {
  const counts = now.map(([le, c], i) => [le, c - (before && before[i] ? before[i][1] : 0)]);
  const total = counts.length ? counts[counts.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [le, count] of counts) {
    if (count >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * ((rank - below) / Math.max(count - below, 1e-12));
    }
    lower = le;
    below = count;
  }
  return lower;
}

export class LivePanel {
  constructor(root, { intervalMs = 1000 } = {}) {
    this.root = root;
    this.intervalMs = intervalMs;
    this.history = []; // { t, ttft, itl, tokens }
    const chart = (id, series, options) => new TimeSeries(root.querySelector(id), series, options);
    const ms = (v) => `${(v * 1000).toFixed(v < 0.01 ? 2 : 1)} ms`;
    this.charts = {
      requests: chart("#chart-requests", ["running", "waiting"], { floor: 1 }),
      kv: chart("#chart-kv", ["used"], { format: (v) => `${v.toFixed(1)} %`, floor: 100 }),
      ttft: chart("#chart-ttft", ["p50", "p99"], { format: ms }),
      itl: chart("#chart-itl", ["p50", "p99"], { format: ms }),
      tokens: chart("#chart-tokens", ["tokens/s"], { format: (v) => v.toFixed(1) }),
    };
    this.status = root.querySelector("#metrics-status");
  }

  start() {
    const tick = async () => {
      await this.poll();
      this.timer = setTimeout(tick, this.intervalMs);
    };
    tick();
  }

  async poll() {
    let samples;
    try {
      const response = await fetch("/metrics", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      samples = parsePrometheus(await response.text());
      this.status.textContent = "live";
    } catch (error) {
      this.status.textContent = `metrics unavailable (${error.message})`;
      return;
    }
    this.update(samples, performance.now());
  }

  // The sample from about `ms` ago (the oldest kept if none is that old).
  since(t, ms) {
    return this.history.find((h) => h.t >= t - ms) || this.history[0];
  }

  update(samples, t) {
    const now = {
      t,
      ttft: buckets(samples, "vivace:time_to_first_token_seconds"),
      itl: buckets(samples, "vivace:inter_token_latency_seconds"),
      tokens: total(samples, "vivace:generation_tokens_total") || 0,
    };
    this.history.push(now);
    while (this.history.length && this.history[0].t < t - WINDOW_MS) this.history.shift();
    const minute = this.since(t, WINDOW_MS);
    const recent = this.since(t, RATE_WINDOW_MS);
    const seconds = (t - recent.t) / 1000;
    const load = engineLoad(samples);
    this.charts.requests.push([load.running, load.waiting]);
    this.charts.kv.push([100 * (load.kv || 0)]);
    this.charts.ttft.push([0.5, 0.99].map((q) => windowQuantile(now.ttft, minute.ttft, q)));
    this.charts.itl.push([0.5, 0.99].map((q) => windowQuantile(now.itl, minute.itl, q)));
    this.charts.tokens.push([seconds > 0 ? (now.tokens - recent.tokens) / seconds : 0]);
  }
}
