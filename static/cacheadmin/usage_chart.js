// Bytes per tier over time on a namespace page, from the series the page embeds (json_script),
// in IEC units (KiB, MiB, GiB; chart_units.js).
(function () {
  "use strict";
  const source = document.getElementById("usage-series");
  const canvas = document.getElementById("usage-chart");
  if (!source || !canvas || typeof Chart === "undefined" || !window.kvcpUnits) return;
  const series = JSON.parse(source.textContent);
  new Chart(canvas, {
    type: "line",
    data: {
      labels: window.kvcpUnits.timeLabels(series.labels),
      datasets: series.datasets.map((d) => ({ label: d.label, data: d.data, spanGaps: true })),
    },
    options: window.kvcpUnits.options("bytes"),
  });
})();
