// Usage page charts, from the console's JSON endpoints (data-url on each canvas).
(function () {
  "use strict";
  if (!window.Chart) return;
  var accent = "#3b5bdb", soft = "#91a7ff", warn = "#e8590c";

  function load(id, build) {
    var canvas = document.getElementById(id);
    if (!canvas) return;
    fetch(canvas.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.json(); })
      .then(function (data) { canvas.chart = new window.Chart(canvas, build(data)); canvas.dataset.ready = "1"; });
  }

  load("chart-daily", function (d) {
    return {
      type: "bar",
      data: {
        labels: d.labels,
        datasets: [
          { type: "bar", label: "Prompt tokens", data: d.prompt_tokens, backgroundColor: soft, stack: "t", yAxisID: "tokens", maxBarThickness: 28 },
          { type: "bar", label: "Completion tokens", data: d.completion_tokens, backgroundColor: accent, stack: "t", yAxisID: "tokens", maxBarThickness: 28 },
          { type: "line", label: "Requests", data: d.requests, borderColor: "#2b8a3e", backgroundColor: "#2b8a3e", yAxisID: "requests" },
          { type: "line", label: "Errors", data: d.errors, borderColor: warn, backgroundColor: warn, yAxisID: "requests" }
        ]
      },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {
          tokens: { position: "left", beginAtZero: true, stacked: true, title: { display: true, text: "tokens" } },
          requests: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, ticks: { precision: 0 },
                      title: { display: true, text: "requests" } },
          x: { stacked: true }
        }
      }
    };
  });

  load("chart-models", function (d) {
    return {
      type: "bar",
      data: { labels: d.labels, datasets: [{ label: "Tokens", data: d.total_tokens, backgroundColor: accent, maxBarThickness: 32 }] },
      options: { animation: false, indexAxis: "y", responsive: true, maintainAspectRatio: false,
                 plugins: { legend: { display: false } }, scales: { x: { beginAtZero: true } } }
    };
  });
})();
