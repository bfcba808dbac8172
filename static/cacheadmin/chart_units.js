// Human units for the charts (window.kvcpUnits): bytes in IEC units (KiB, MiB, GiB), durations in
// ms / s / min, ratios and shares in %, rates per second, counts with separators, and ISO times as
// clock times (with the date when a series spans more than a day).
(function () {
  "use strict";
  function iec(bytes) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let value = Math.abs(bytes), i = 0;
    while (value >= 1024 && i < units.length - 1) { value /= 1024; i += 1; }
    return (bytes < 0 ? "-" : "") + (i === 0 ? String(Math.round(value)) : value.toFixed(value < 10 ? 1 : 0)) + " " + units[i];
  }
  function ms(value) {
    if (value < 1000) return (value < 10 ? value.toFixed(1) : value.toFixed(0)) + " ms";
    if (value < 60000) return (value / 1000).toFixed(1) + " s";
    return (value / 60000).toFixed(1) + " min";
  }
  function rate(value) {
    if (value === 0) return "0/s";
    return (value < 1 ? value.toFixed(2) : value < 10 ? value.toFixed(1) : value.toFixed(0)) + "/s";
  }
  // Byte ticks on whole binary steps (1, 2, 4, 8... KiB / MiB / GiB), not on decimal ones (9.5 MiB, 19 MiB...).
  function binaryTicks(axis) {
    const max = axis.max;
    if (!(max > 0)) return;
    let unit = 1;
    while (unit * 1024 <= max) unit *= 1024;
    let step = unit;
    while (max / step > 8) step *= 2;
    while (max / step < 3 && step > 1) step /= 2;
    axis.ticks = [];
    for (let v = 0; v <= max + step / 1e6; v += step) axis.ticks.push({ value: v });
  }
  const format = {
    ratio: (v) => (v * 100).toFixed(0) + " %",
    // A small ratio (an error rate): the axis follows the data, not 0-100 %.
    share: (v) => (v * 100).toFixed(v < 0.1 ? 1 : 0) + " %",
    percent: (v) => Number(v).toFixed(0) + " %",
    ms: ms,
    bytes: iec,
    rate: rate,
    tokens: (v) => Number(v).toLocaleString(),
    count: (v) => Number(v).toLocaleString(),
  };
  const ISO = /^\d{4}-\d\d-\d\dT/;
  function timeLabels(labels) {
    const times = labels.filter((t) => ISO.test(t)).map((t) => new Date(t).getTime());
    const long = times.length > 1 && Math.max(...times) - Math.min(...times) > 86400000;
    return labels.map((t) => {
      if (!ISO.test(t)) return t;
      const d = new Date(t);
      const clock = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
      return long ? d.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + clock : clock;
    });
  }
  // Chart.js options for a unit: y axis from 0 (ratios to 100 %), ticks and tooltips in the unit.
  function options(unit) {
    const fmt = format[unit] || String;
    return {
      animation: false,
      maintainAspectRatio: false,
      scales: {
        x: { ticks: { autoSkip: true, maxTicksLimit: 8, maxRotation: 0 } },
        y: {
          beginAtZero: true,
          max: unit === "ratio" ? 1 : unit === "percent" ? 100 : undefined,
          ticks: { callback: (v) => fmt(v), precision: unit === "count" ? 0 : undefined },
          afterBuildTicks: unit === "bytes" ? binaryTicks : undefined,
        },
      },
      plugins: { tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${c.parsed.y === null ? "—" : fmt(c.parsed.y)}` } } },
    };
  }
  window.kvcpUnits = { format: format, iec: iec, ms: ms, rate: rate, timeLabels: timeLabels, options: options };
})();
