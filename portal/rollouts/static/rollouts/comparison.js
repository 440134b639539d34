// The adapter page's per-version charts: the comparison JSON (a json_script element, read as
// text and parsed, never put into the DOM as markup) becomes one Chart.js line chart per
// <canvas data-metric>, a line per version. Without Chart.js the table still shows everything.
(function () {
  "use strict";
  var source = document.getElementById("version-comparison-data");
  if (!source || typeof Chart === "undefined") return;
  var data = JSON.parse(source.textContent);
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
  var labels = data.starts.map(function (iso) {
    var s = new Date(iso).toISOString();
    return data.range.range === "7d" ? s.slice(5, 10) + " " + s.slice(11, 16) : s.slice(11, 16);
  });
  document.querySelectorAll("#version-comparison canvas[data-metric]").forEach(function (canvas) {
    var metric = canvas.getAttribute("data-metric");
    var datasets = data.series.map(function (s, i) {
      var c = PALETTE[i % PALETTE.length];
      return { label: s.label, data: s[metric], borderColor: c, backgroundColor: c, spanGaps: true, pointRadius: 1 };
    });
    new Chart(canvas, { type: "line", data: { labels: labels, datasets: datasets },
      options: { responsive: true, maintainAspectRatio: false, animation: false,
                 interaction: { mode: "index", intersect: false }, scales: { y: { beginAtZero: true } } } });
  });
})();
