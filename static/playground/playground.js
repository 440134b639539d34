// The playground: one websocket per page, one generation at a time. Model output is only ever
// put into the page as text (textContent / createTextNode), never parsed as HTML.
(function () {
  "use strict";
  var root = document.getElementById("playground");
  if (!root) return;
  var form = document.getElementById("pg-form");
  var log = document.getElementById("pg-log");
  var input = document.getElementById("pg-input");
  var model = document.getElementById("pg-model");
  var maxTokens = document.getElementById("pg-max-tokens");
  var temperature = document.getElementById("pg-temperature");
  var send = document.getElementById("pg-send");
  var stop = document.getElementById("pg-stop");
  var clear = document.getElementById("pg-clear");
  var stats = document.getElementById("pg-stats");
  var status = document.getElementById("pg-status");
  var canSend = !send.disabled;

  var history = [];       // [{role, content}] sent with every turn
  var current = null;     // {node, text, started, first, tokens}
  var socket = null;

  function addMessage(role, text) {
    var p = document.createElement("p");
    p.className = "pg-msg " + role;
    var who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : "Error";
    var body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    p.appendChild(who);
    p.appendChild(body);
    log.appendChild(p);
    log.scrollTop = log.scrollHeight;
    return body;
  }

  function busy(running) {
    send.disabled = running || !canSend || !socket || socket.readyState !== WebSocket.OPEN;
    stop.disabled = !running;
  }

  function finish() {
    if (current && current.text) history.push({ role: "assistant", content: current.text });
    current = null;
    busy(false);
  }

  function showStats(ttftMs, tokensPerSecond) {
    var parts = [];
    if (ttftMs != null) parts.push("time to first token " + Math.round(ttftMs) + " ms");
    if (tokensPerSecond != null) parts.push(tokensPerSecond.toFixed(1) + " tokens/s");
    stats.textContent = parts.join(" · ");
  }

  function liveStats() {
    if (!current || current.first == null) return;
    var seconds = (performance.now() - current.first) / 1000;
    showStats(current.first - current.started, seconds > 0 && current.tokens > 1 ? (current.tokens - 1) / seconds : null);
  }

  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + root.dataset.wsPath);
    socket.onopen = function () { status.textContent = "connected"; busy(false); };
    socket.onclose = function () {
      status.textContent = "disconnected — reload the page to reconnect";
      if (current) finish();
      busy(false);
    };
    socket.onmessage = function (event) {
      var msg;
      try { msg = JSON.parse(event.data); } catch (e) { return; }
      if (msg.type === "delta" && current) {
        if (current.first == null) current.first = performance.now();
        current.text += msg.text;
        current.tokens += 1;
        current.node.textContent = current.text;
        log.scrollTop = log.scrollHeight;
        liveStats();
      } else if (msg.type === "usage" && current) {
        current.tokens = msg.completion_tokens || current.tokens;
      } else if (msg.type === "done") {
        showStats(msg.ttft_ms, msg.tokens_per_second);
        status.textContent = msg.finish_reason === "length" ? "done (max tokens reached)" : "done";
        finish();
      } else if (msg.type === "cancelled") {
        status.textContent = "stopped";
        finish();
      } else if (msg.type === "error") {
        addMessage("error", msg.message || "error");
        status.textContent = "error";
        if (current && !current.text) history.pop();  // the turn that failed
        finish();
      }
    };
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    var text = input.value.trim();
    if (!text || current || !socket || socket.readyState !== WebSocket.OPEN) return;
    history.push({ role: "user", content: text });
    addMessage("user", text);
    input.value = "";
    current = { node: addMessage("assistant", ""), text: "", started: performance.now(), first: null, tokens: 0 };
    stats.textContent = "";
    status.textContent = "generating…";
    busy(true);
    var message = { type: "chat", model: model.value, messages: history.slice() };
    var n = parseInt(maxTokens.value, 10);
    if (n > 0) message.max_tokens = n;
    var t = parseFloat(temperature.value);
    if (!isNaN(t)) message.temperature = t;
    socket.send(JSON.stringify(message));
  });

  stop.addEventListener("click", function () {
    if (socket && current) socket.send(JSON.stringify({ type: "cancel" }));
  });

  clear.addEventListener("click", function () {
    if (current) return;
    history = [];
    while (log.firstChild) log.removeChild(log.firstChild);
    stats.textContent = "";
  });

  busy(false);
  connect();
})();
