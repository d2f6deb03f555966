// Small canvas charts: a time series of a few named lines (told apart by dash pattern and a
// text legend, not colour alone) and an inter-token-gap sparkline. No library, no build step.

const DASHES = [[], [5, 3], [2, 2]];

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

function cssColor(element, name, fallback) {
  return getComputedStyle(element).getPropertyValue(name).trim() || fallback;
}

// A chart of `series` names over the last `capacity` samples; null values leave gaps.
export class TimeSeries {
  constructor(figure, series, { capacity = 120, format = (v) => String(v), floor = 0 } = {}) {
    this.figure = figure;
    this.canvas = figure.querySelector("canvas");
    this.valueText = figure.querySelector(".value");
    this.series = series;
    this.capacity = capacity;
    this.format = format;
    this.floor = floor;
    this.samples = [];
  }

  push(values) {
    this.samples.push(values);
    if (this.samples.length > this.capacity) this.samples.shift();
    this.figure.dataset.samples = String(Number(this.figure.dataset.samples || 0) + 1);
    this.valueText.textContent = this.series
      .map((name, i) => `${name} ${values[i] == null ? "—" : this.format(values[i])}`)
      .join(" · ");
    this.draw();
  }

  draw() {
    const { ctx, width, height } = fitCanvas(this.canvas);
    const finite = this.samples.flat().filter((v) => v != null && Number.isFinite(v));
    const top = Math.max(this.floor, ...finite) || 1;
    const x = (i) => width - (this.samples.length - 1 - i) * (width / (this.capacity - 1));
    const y = (v) => height - 2 - (v / top) * (height - 4);
    ctx.strokeStyle = cssColor(this.figure, "--grid", "#ccc");
    ctx.lineWidth = 1;
    ctx.setLineDash([]);
    ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
    ctx.strokeStyle = cssColor(this.figure, "--ink", "#222");
    ctx.lineWidth = 1.5;
    this.series.forEach((_, s) => {
      ctx.setLineDash(DASHES[s % DASHES.length]);
      ctx.beginPath();
      let drawing = false;
      this.samples.forEach((values, i) => {
        const v = values[s];
        if (v == null || !Number.isFinite(v)) { drawing = false; return; }
        if (drawing) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
        drawing = true;
      });
      ctx.stroke();
    });
    this.canvas.setAttribute("aria-label",
      `${this.figure.querySelector("figcaption").textContent}: ${this.valueText.textContent}`);
  }
}

// Bars of the gaps between tokens (milliseconds), newest at the right.
export function drawSparkline(canvas, gaps) {
  const { ctx, width, height } = fitCanvas(canvas);
  if (!gaps.length) return;
  const top = Math.max(...gaps) || 1;
  const step = width / Math.max(gaps.length, 40);
  const shown = gaps.slice(-Math.floor(width / step));
  ctx.fillStyle = cssColor(canvas, "--ink", "#222");
  shown.forEach((gap, i) => {
    const h = Math.max(1, (gap / top) * (height - 2));
    ctx.fillRect(i * step, height - h, Math.max(1, step - 1), h);
  });
}
