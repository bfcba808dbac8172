// The dashboard's charts: drawn once from /dashboard/charts.json, then updated
// in place (chart.update(), the canvas stays) at the section's poll interval,
// never while the tab is hidden. Units: ratios 0..1 shown as %, ms, bytes (IEC), tokens.
(function () {
  "use strict";
  const section = document.getElementById("charts");
  if (!section || typeof Chart === "undefined") return;
  const url = section.dataset.chartsUrl;
  const pollMs = Math.max(2, Number(section.dataset.pollS) || 15) * 1000;
  const charts = new Map();

  function iec(bytes) {
    const units = ["Bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let value = Math.abs(bytes), i = 0;
    while (value >= 1024 && i < units.length - 1) { value /= 1024; i += 1; }
    return (bytes < 0 ? "-" : "") + (i === 0 ? String(value) : value.toFixed(1)) + " " + units[i];
  }
  function ms(value) {
    if (value < 1000) return (value < 10 ? value.toFixed(1) : value.toFixed(0)) + " ms";
    if (value < 60000) return (value / 1000).toFixed(1) + " s";
    return (value / 60000).toFixed(1) + " min";
  }
  const format = {
    ratio: (v) => (v * 100).toFixed(1) + " %",
    ms: ms,
    bytes: iec,
    tokens: (v) => Number(v).toLocaleString(),
  };
  function label(t) {
    // ISO times become local clock times; other labels stay as they are.
    return /^\d{4}-\d\d-\d\dT/.test(t) ? new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : t;
  }

  function draw(canvas, series) {
    const unit = canvas.dataset.unit;
    const fmt = format[unit] || String;
    const data = {
      labels: series.labels.map(label),
      datasets: series.datasets.map((d) => ({ label: d.label, data: d.data, spanGaps: true })),
    };
    let chart = charts.get(canvas.id);
    if (chart) {
      chart.data.labels = data.labels;
      // Keep dataset objects where the label matches, so Chart.js animates nothing and keeps toggles.
      chart.data.datasets = data.datasets.map((d) => {
        const old = chart.data.datasets.find((o) => o.label === d.label);
        if (old) { old.data = d.data; return old; }
        return d;
      });
      chart.update();
      return;
    }
    chart = new Chart(canvas, {
      type: canvas.dataset.kind || "line",
      data: data,
      options: {
        animation: false,
        maintainAspectRatio: false,
        scales: {
          y: {
            beginAtZero: true,
            max: unit === "ratio" ? 1 : undefined,
            ticks: { callback: (v) => fmt(v) },
          },
        },
        plugins: { tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${c.parsed.y === null ? "—" : fmt(c.parsed.y)}` } } },
      },
    });
    charts.set(canvas.id, chart);
  }

  async function refresh() {
    if (document.visibilityState !== "visible") return;
    try {
      const response = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      // Signed out (401 in the error envelope): to the sign-in page, as the sections' polls do (app.js).
      if (response.status === 401 && window.kvcpSignIn) { window.kvcpSignIn(); return; }
      if (!response.ok || !(response.headers.get("Content-Type") || "").includes("json")) return;
      const body = await response.json();
      section.querySelectorAll("canvas[data-series]").forEach((canvas) => {
        if (body[canvas.dataset.series]) draw(canvas, body[canvas.dataset.series]);
      });
      section.dataset.updatedAt = body.generated_at;
    } catch (error) {
      // A failed poll keeps the last picture; the next one tries again.
    }
  }
  refresh();
  setInterval(refresh, pollMs);
  document.addEventListener("visibilitychange", refresh);
})();
