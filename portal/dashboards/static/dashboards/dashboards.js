// Dashboards: every <canvas data-chart="KIND" data-src="/dashboards/api/...json"> becomes a
// Chart.js chart of that JSON. Charts draw on the canvas: no data reaches the DOM as markup.
(function () {
  "use strict";
  if (typeof Chart === "undefined") return;  // the tables still show everything

  var MEMORY = ["base_weights", "kv_cache", "adapter_slots", "host_adapters"];
  var MIB = 1024 * 1024;

  function bars(labels, datasets, options) {
    return { type: "bar", data: { labels: labels, datasets: datasets },
             options: Object.assign({ responsive: true, maintainAspectRatio: false }, options || {}) };
  }

  var builders = {
    "fleet-queue": function (data) {
      var w = data.workers;
      return bars(w.map(function (x) { return x.name; }), [
        { label: "running", data: w.map(function (x) { return x.num_running; }) },
        { label: "waiting", data: w.map(function (x) { return x.num_waiting; }) }
      ], { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "requests" } } } });
    },
    "fleet-cache": function (data) {
      // Where each adapter request found its adapter: a device slot, host memory, or disk (cold).
      var w = data.workers;
      function part(x, key) {
        if (!x.cache) return 0;
        return key === "cold" ? Math.min(x.cache.misses, x.cache.requests) :
          key === "host" ? x.cache.hits.host - Math.min(x.cache.misses, x.cache.requests) : x.cache.hits.device;
      }
      return bars(w.map(function (x) { return x.name; }), ["device", "host", "cold"].map(function (key) {
        return { label: key === "device" ? "in a slot" : key === "host" ? "in host memory" : "loaded from disk",
                 data: w.map(function (x) { return Math.max(part(x, key), 0); }) };
      }), { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "adapter requests" } } } });
    },
    "fleet-memory": function (data) {
      var w = data.workers;
      return bars(w.map(function (x) { return x.name; }), MEMORY.map(function (kind) {
        return { label: kind.replace("_", " "), data: w.map(function (x) { return (x.memory[kind] || 0) / MIB; }) };
      }), { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "MiB" } } } });
    },
    "tenants": function (data) {
      var t = data.tenants;
      return bars(t.map(function (x) { return x.slug; }), [
        { label: "prompt tokens", data: t.map(function (x) { return x.prompt_tokens; }) },
        { label: "completion tokens", data: t.map(function (x) { return x.completion_tokens; }) }
      ], { scales: { x: { stacked: true }, y: { stacked: true } } });
    },
    "latency": function (data) {
      var days = data.days;
      var series = [];
      ["ttft_ms", "latency_ms"].forEach(function (metric) {
        ["p50", "p95", "p99"].forEach(function (p) {
          series.push({ label: (metric === "ttft_ms" ? "TTFT " : "latency ") + p, spanGaps: true,
                        borderDash: metric === "ttft_ms" ? [4, 3] : [],
                        data: days.map(function (d) { return d[metric][p]; }) });
        });
      });
      return { type: "line", data: { labels: days.map(function (d) { return d.date; }), datasets: series },
               options: { responsive: true, maintainAspectRatio: false,
                          scales: { y: { title: { display: true, text: "ms" } } } } };
    },
    "adapters": function (data) {
      var a = data.adapters;
      return bars(a.map(function (x) { return x.model; }),
                  [{ label: "tokens", data: a.map(function (x) { return x.total_tokens; }) }], { indexAxis: "y" });
    },
    "billing": function (data) {
      var t = data.tenants;
      return bars(t.map(function (x) { return x.slug; }),
                  [{ label: "cost (USD)", data: t.map(function (x) { return parseFloat(x.cost); }) }]);
    }
  };

  // One request per distinct URL: the fleet page's three charts read the same fleet.json.
  var loads = {};
  function load(src) {
    if (!loads[src]) {
      loads[src] = fetch(src, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); });
    }
    return loads[src];
  }

  document.querySelectorAll("canvas[data-chart]").forEach(function (canvas) {
    var build = builders[canvas.dataset.chart];
    if (!build) return;
    load(canvas.dataset.src)
      .then(function (data) { new Chart(canvas, build(data)); })
      .catch(function (e) {
        var p = document.createElement("p");
        p.className = "bad";
        p.textContent = "The chart could not load (" + e.message + ").";
        canvas.replaceWith(p);
      });
  });
})();
