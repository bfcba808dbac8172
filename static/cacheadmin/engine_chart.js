// An engine's prefix-cache hit ratio between scrapes, from the series the live
// fragment embeds (json_script "engine-hit-series"); redrawn when the fragment is swapped.
(function () {
  "use strict";
  const canvas = document.getElementById("engine-hit-chart");
  if (!canvas || typeof Chart === "undefined") return;
  let chart = null;
  function draw() {
    const source = document.getElementById("engine-hit-series");
    if (!source) return;
    const series = JSON.parse(source.textContent);
    // Clock times, with the date once the series spans more than a day (chart_units.js).
    const labels = window.kvcpUnits ? window.kvcpUnits.timeLabels(series.labels) : series.labels;
    const data = series.hit_ratio.map((r) => (r === null ? null : r * 100));
    if (chart) {
      chart.data.labels = labels;
      chart.data.datasets[0].data = data;
      chart.update("none");
      return;
    }
    chart = new Chart(canvas, {
      type: "line",
      data: { labels: labels, datasets: [{ label: "prefix-cache hit ratio (%)", data: data, spanGaps: false }] },
      options: {
        animation: false,
        maintainAspectRatio: false,
        scales: {
          x: { ticks: { autoSkip: true, maxTicksLimit: 8, maxRotation: 0 } },
          y: { min: 0, max: 100, ticks: { callback: (v) => v + " %" } },
        },
        plugins: { tooltip: { callbacks: { label: (c) => (c.parsed.y === null ? "no queries" : c.parsed.y.toFixed(1) + " %") } } },
      },
    });
  }
  draw();
  // After any settle: an outerHTML swap replaces the element the event was bound to.
  document.body.addEventListener("htmx:afterSettle", draw);
})();
