// Bytes per tier over time on a namespace page, from the series the page embeds (json_script).
(function () {
  "use strict";
  const source = document.getElementById("usage-series");
  const canvas = document.getElementById("usage-chart");
  if (!source || !canvas || typeof Chart === "undefined") return;
  const series = JSON.parse(source.textContent);
  new Chart(canvas, {
    type: "line",
    data: {
      labels: series.labels.map((t) => new Date(t).toLocaleString()),
      datasets: series.datasets.map((d) => ({ label: d.label, data: d.data, spanGaps: true })),
    },
    options: { animation: false, scales: { y: { beginAtZero: true, title: { display: true, text: "bytes" } } } },
  });
})();
