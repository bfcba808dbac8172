// The dashboard's charts: drawn once from /dashboard/charts.json, then updated
// in place (chart.update(), the canvas stays) at the section's poll interval,
// never while the tab is hidden. Units (chart_units.js): ratios 0..1 shown as %, ms / s, bytes in
// KiB / MiB / GiB, requests per second, tokens; time axes hold the minutes with data only (the server cuts them).
(function () {
  "use strict";
  const section = document.getElementById("charts");
  if (!section || typeof Chart === "undefined") return;
  const url = section.dataset.chartsUrl;
  const pollMs = Math.max(2, Number(section.dataset.pollS) || 15) * 1000;
  const charts = new Map();

  const units = window.kvcpUnits;
  if (!units) return;

  function draw(canvas, series) {
    const unit = canvas.dataset.unit;
    const data = {
      labels: units.timeLabels(series.labels),
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
    chart = new Chart(canvas, { type: canvas.dataset.kind || "line", data: data, options: units.options(unit) });
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
