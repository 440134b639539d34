// Dashboards: every <canvas data-chart="KIND" data-src="/dashboards/api/...json"> becomes a
// Chart.js chart of that JSON, and every [data-field][data-src] shows one number of it. On a live
// range (#dash-live, a short range ending now) the page fetches each JSON again every
// data-refresh-s seconds while the tab is visible and redraws in place (chart.update('none')).
// Charts draw on the canvas and numbers go in as textContent: no data reaches the DOM as markup.
(function () {
  "use strict";

  // The range form: custom start/end only matter (and only show) with range=custom.
  var rangeName = document.getElementById("range-name");
  var custom = document.querySelector(".custom-range");
  if (rangeName && custom) {
    var toggle = function () { custom.style.display = rangeName.value === "custom" ? "" : "none"; };
    rangeName.addEventListener("change", toggle);
    toggle();
  }

  if (typeof Chart === "undefined") return;  // the tables still show everything

  var MEMORY = ["base_weights", "kv_cache", "adapter_slots", "host_adapters"];
  var MIB = 1024 * 1024;
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
  var PCTS = ["p50", "p95", "p99"];

  function color(i) { return PALETTE[i % PALETTE.length]; }
  function paint(datasets) {
    // Explicit colours on every dataset (Chart.js drops its palette once any dataset has one).
    datasets.forEach(function (d, i) {
      var c = d.color || color(i);
      delete d.color;
      if (!d.borderColor) d.borderColor = c;
      if (!d.backgroundColor) d.backgroundColor = d.type === "bar" || d.fill ? c + "99" : c;
    });
    return datasets;
  }
  function base(options) {
    return Object.assign({ responsive: true, maintainAspectRatio: false, animation: false,
                           interaction: { mode: "index", intersect: false } }, options || {});
  }
  function bars(labels, datasets, options) {
    return { type: "bar", data: { labels: labels, datasets: paint(datasets) }, options: base(options) };
  }
  function lines(labels, datasets, options) {
    return { type: "line", data: { labels: labels, datasets: paint(datasets) }, options: base(options) };
  }
  function axis(text, extra) { return Object.assign({ beginAtZero: true, title: { display: true, text: text } }, extra || {}); }

  // Bucket starts (ISO, UTC) as axis labels: the time of day on short ranges, the date on long ones.
  // `seconds`: the width served (the latency JSON may serve another than the range's).
  function timeLabels(starts, range, seconds) {
    seconds = seconds || (range && range.bucket_seconds) || 60;
    var span = range ? (Date.parse(range.end) - Date.parse(range.start)) / 1000 : 0;
    return starts.map(function (iso) {
      var s = new Date(iso).toISOString();  // always UTC, "YYYY-MM-DDTHH:MM:SS.sssZ"
      if (seconds >= 86400) return s.slice(0, 10);
      if (span > 86400) return s.slice(5, 10) + " " + s.slice(11, 16);
      return s.slice(11, 16);
    });
  }

  // Worker health changes as vertical markers: each annotation {at, worker, kind, detail} sits at
  // its moment between the bucket starts around it. Kept on chart.$markers (replaced on refresh).
  function markerPositions(starts, annotations) {
    var times = starts.map(function (iso) { return Date.parse(iso); });
    return (annotations || []).map(function (a) {
      var at = Date.parse(a.at), i = times.length - 1;
      while (i > 0 && times[i] > at) i--;
      var width = times.length > 1 ? times[1] - times[0] : 60000;
      return { index: i, fraction: Math.max(0, Math.min(1, (at - times[i]) / width)), kind: a.kind,
               label: (a.worker ? a.worker + ": " : "") + a.kind };
    }).filter(function (m) { return m.index >= 0; });
  }
  var GOOD = /^(healthy|became.healthy|back|recovered|ready)/i, BAD = /unhealthy|gone|down|mismatch|error|fail|drain/i;
  var markersPlugin = {
    id: "healthMarkers",
    afterDatasetsDraw: function (chart) {
      var items = chart.$markers || [], x = chart.scales.x, area = chart.chartArea, ctx = chart.ctx;
      if (!items.length || !x) return;
      ctx.save();
      ctx.font = "10px sans-serif";
      ctx.lineWidth = 1;
      items.forEach(function (m, n) {
        var left = x.getPixelForValue(m.index);
        var right = m.index + 1 < chart.data.labels.length ? x.getPixelForValue(m.index + 1) : left;
        var px = left + (right - left) * m.fraction;
        if (px < area.left - 1 || px > area.right + 1) return;
        var c = GOOD.test(m.kind) ? "#2b8a3e" : BAD.test(m.kind) ? "#b02a37" : "#666";
        ctx.strokeStyle = c;
        ctx.fillStyle = c;
        ctx.setLineDash([4, 3]);
        ctx.beginPath();
        ctx.moveTo(px, area.top);
        ctx.lineTo(px, area.bottom);
        ctx.stroke();
        ctx.fillText(m.label, Math.min(px + 3, area.right - 60), area.top + 10 + (n % 4) * 11);
      });
      ctx.restore();
    }
  };

  function percentiles(buckets, metric, name, options) {
    return PCTS.map(function (p, i) {
      return Object.assign({ label: name + " " + p, spanGaps: true, color: color(i), pointRadius: 2,
                             data: buckets.map(function (b) { return b[metric] ? b[metric][p] : null; }) }, options || {});
    });
  }
  function latencyChart(metric, name) {
    return function (data) {
      return lines(timeLabels(data.buckets.map(function (b) { return b.start; }), data.range, data.bucket_seconds),
                   percentiles(data.buckets, metric, name), { scales: { y: axis("ms") } });
    };
  }
  function gauge(series) { return series || []; }
  function present(map, tiers) { return tiers.filter(function (t) { return map && map[t]; }); }

  function historyChart(make) {
    return function (data) {
      var config = make(data, data.series || {}, timeLabels(data.buckets || [], data.range));
      config.plugins = [markersPlugin];
      config.markers = markerPositions(data.buckets || [], data.annotations);
      return config;
    };
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
    "history-requests": historyChart(function (data, s, labels) {
      return lines(labels, [{ label: "running", data: gauge(s.num_running) },
                            { label: "waiting", data: gauge(s.num_waiting) }], { scales: { y: axis("requests") } });
    }),
    "history-kv": historyChart(function (data, s, labels) {
      return lines(labels, [{ label: "KV cache used", fill: true, data: gauge(s.kv_cache_usage).map(function (v) {
        return v === null || v === undefined ? null : v * 100; }) }], { scales: { y: axis("%", { max: 100 }) } });
    }),
    "history-adapters": historyChart(function (data, s, labels) {
      var tiers = s.adapters || {};
      return lines(labels, Object.keys(tiers).map(function (tier) {
        return { label: tier === "device" ? "in device slots" : tier === "host" ? "in host memory" : tier, data: tiers[tier] };
      }), { scales: { y: axis("adapters") } });
    }),
    "history-swaps": historyChart(function (data, s, labels) {
      // loads: disk -> host ("host"), host -> device slot ("device"); evictions by the tier left.
      var sets = [];
      present(s.loads_per_min, ["host", "device"]).forEach(function (tier) {
        sets.push({ label: tier === "host" ? "loads into host memory" : "loads into a slot", data: s.loads_per_min[tier] });
      });
      present(s.evictions_per_min, ["device", "host"]).forEach(function (tier) {
        sets.push({ label: "evictions from " + (tier === "device" ? "slots" : "host memory"), borderDash: [4, 3],
                    data: s.evictions_per_min[tier] });
      });
      if (s.load_failures_per_min) sets.push({ label: "failed loads", color: "#b02a37", data: s.load_failures_per_min });
      return lines(labels, sets, { scales: { y: axis("per minute") } });
    }),
    "history-memory": historyChart(function (data, s, labels) {
      var memory = s.memory || {};
      return lines(labels, Object.keys(memory).map(function (kind) {
        return { label: kind.replace("_", " "), fill: true, data: memory[kind].map(function (v) {
          return v === null || v === undefined ? null : v / MIB; }) };
      }), { scales: { y: axis("MiB", { stacked: true }) } });
    }),
    "tenants": function (data) {
      var t = data.tenants;
      return bars(t.map(function (x) { return x.slug; }), [
        { label: "prompt tokens", data: t.map(function (x) { return x.prompt_tokens; }) },
        { label: "completion tokens", data: t.map(function (x) { return x.completion_tokens; }) }
      ], { scales: { x: { stacked: true }, y: { stacked: true } } });
    },
    "latency-ttft": latencyChart("ttft_ms", "TTFT"),
    "latency-itl": latencyChart("itl_ms", "inter-token"),
    "latency-e2e": latencyChart("latency_ms", "end to end"),
    "latency-queue": latencyChart("queue_ms", "queue"),
    "latency-cold": function (data) {
      // The cold-start cost and its trend: TTFT of requests whose adapter was in a slot (warm) vs
      // loaded for them (cold), and how many were cold (bars, right axis).
      var b = data.buckets;
      function pct(key, p) { return b.map(function (x) { return x[key] ? x[key][p] : null; }); }
      return lines(timeLabels(b.map(function (x) { return x.start; }), data.range, data.bucket_seconds), [
        { label: "warm p50", color: "#2ca02c", spanGaps: true, data: pct("ttft_warm_ms", "p50") },
        { label: "warm p95", color: "#98df8a", spanGaps: true, data: pct("ttft_warm_ms", "p95") },
        { label: "cold p50", color: "#d62728", spanGaps: true, data: pct("ttft_cold_ms", "p50") },
        { label: "cold p95", color: "#ff9896", spanGaps: true, borderDash: [4, 3], data: pct("ttft_cold_ms", "p95") },
        { label: "cold requests", type: "bar", color: "#7f7f7f", yAxisID: "y1", order: 10,
          data: b.map(function (x) { return x.cold_requests; }) }
      ], { scales: { y: axis("TTFT ms"), y1: axis("cold requests", { position: "right", grid: { drawOnChartArea: false } }) } });
    },
    "errors": function (data) {
      var reds = ["#d62728", "#ff9896", "#8c1c13", "#e377c2"], oranges = ["#ff7f0e", "#ffbb78", "#bcbd22", "#8c564b"];
      var sets = data.series.map(function (s, i) {
        var family = s.status >= 500 ? reds : s.status === 429 ? oranges : ["#1f77b4", "#aec7e8", "#9467bd", "#17becf"];
        return { label: (s.status + " " + (s.code || "")).trim(), type: "bar", stack: "errors",
                 color: family[i % family.length], data: s.counts };
      });
      sets.push({ label: "retried on another worker", type: "line", color: "#333", yAxisID: "y1", data: data.retries });
      return bars(timeLabels(data.buckets, data.range), sets, {
        scales: { x: { stacked: true }, y: axis("errors", { stacked: true }),
                  y1: axis("retried requests", { position: "right", grid: { drawOnChartArea: false } }) } });
    },
    "objectives": function (data) {
      var t = data.tenants;
      return bars(t.map(function (x) { return x.slug + (x.missing_now ? " (missing now)" : ""); }), [
        { label: "p95 over the range", data: t.map(function (x) { return x.p95_ms; }) },
        { label: "p95 now (last " + data.window_minutes + " min)", data: t.map(function (x) { return x.p95_now_ms; }) },
        { label: "target", type: "line", showLine: false, pointStyle: "line", pointRadius: 14, borderWidth: 3,
          color: "#b02a37", data: t.map(function (x) { return x.target_ms; }) }
      ], { scales: { y: axis("TTFT ms") } });
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

  function fetchJson(src) {
    return fetch(src, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); });
  }
  function field(data, path) {
    return path.split(".").reduce(function (v, key) { return v === null || v === undefined ? v : v[key]; }, data);
  }

  // Charts and fields grouped by their JSON: one request per distinct URL per refresh.
  var sources = {};
  document.querySelectorAll("canvas[data-chart], [data-field][data-src], [data-hide-when][data-src]").forEach(function (el) {
    var src = el.dataset.src;
    (sources[src] = sources[src] || []).push(el);
  });

  function show(src, data) {
    sources[src].forEach(function (el) {
      if (el.dataset.hideWhen) {  // an "empty" note: gone once the JSON has what it said was missing
        var found = field(data, el.dataset.hideWhen);
        el.hidden = Array.isArray(found) ? found.length > 0 : !!found;
        return;
      }
      if (el.tagName !== "CANVAS") {
        var value = field(data, el.dataset.field);
        el.textContent = value === null || value === undefined ? "" : String(value);
        return;
      }
      var build = builders[el.dataset.chart];
      if (!build) return;
      var config = build(data), chart = Chart.getChart(el);
      if (chart) {
        chart.data = config.data;
        chart.$markers = config.markers;
        chart.update("none");
      } else {
        chart = new Chart(el, config);
        chart.$markers = config.markers;
        if (config.markers && config.markers.length) chart.draw();
      }
    });
  }
  function fail(src, e) {
    sources[src].forEach(function (el) {
      if (el.tagName !== "CANVAS" || Chart.getChart(el)) return;
      var p = document.createElement("p");
      p.className = "bad";
      p.textContent = "The chart could not load (" + e.message + ").";
      el.replaceWith(p);
    });
  }
  function loadAll() {
    return Promise.all(Object.keys(sources).map(function (src) {
      return fetchJson(src).then(function (data) { show(src, data); return true; },
                                 function (e) { fail(src, e); throw e; });
    }));
  }

  var first = loadAll();
  var live = document.getElementById("dash-live");
  var refreshMs = live ? 1000 * parseFloat(live.dataset.refreshS) : 0;
  if (!live || !(refreshMs > 0)) return;
  var stamp = document.getElementById("dash-updated");
  var note = document.createElement("span");
  note.className = "bad";
  live.appendChild(note);
  var busy = false, last = Date.now();

  function refresh() {
    if (busy || document.hidden) return;
    busy = true;
    loadAll().then(function () {
      stamp.textContent = new Date().toISOString().slice(11, 19);
      stamp.setAttribute("datetime", new Date().toISOString());
      note.textContent = "";
    }, function (e) {
      note.textContent = " (refresh failed: " + e.message + ")";
    }).then(function () { busy = false; last = Date.now(); });
  }
  first.then(function () { last = Date.now(); }, function () {});
  setInterval(refresh, refreshMs);
  // Back on a tab hidden for a while: catch up at once instead of waiting for the next tick.
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && Date.now() - last >= refreshMs) refresh();
  });
})();
