// A release's charts (traffic split, hit ratio, request rate, shadow verdicts) from the series the
// page embeds (json_script "release-series"), in human units (chart_units.js).
(function () {
  "use strict";
  const source = document.getElementById("release-series");
  if (!source || typeof Chart === "undefined" || !window.kvcpUnits) return;
  const body = JSON.parse(source.textContent);
  document.querySelectorAll("#release-charts canvas[data-series]").forEach((canvas) => {
    const series = body[canvas.dataset.series];
    if (!series) return;
    const bar = canvas.dataset.kind === "bar";
    const chart = new Chart(canvas, {
      type: bar ? "bar" : "line",
      data: {
        labels: window.kvcpUnits.timeLabels(series.labels),
        datasets: series.datasets.map((d) => ({ label: d.label, data: d.data, spanGaps: true, stepped: d.label.startsWith("planned") })),
      },
      options: window.kvcpUnits.options(canvas.dataset.unit),
    });
    if (bar) { chart.options.scales.x.stacked = true; chart.options.scales.y.stacked = true; chart.update(); }
  });
})();
