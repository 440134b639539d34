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
  var schemaBox = document.getElementById("pg-schema");
  var toolsBox = document.getElementById("pg-tools");
  var toolChoice = document.getElementById("pg-tool-choice");
  var boxError = document.getElementById("pg-box-error");
  var structured = document.getElementById("pg-structured");
  var send = document.getElementById("pg-send");
  var stop = document.getElementById("pg-stop");
  var clear = document.getElementById("pg-clear");
  var stats = document.getElementById("pg-stats");
  var status = document.getElementById("pg-status");
  var canSend = !send.disabled;

  var history = [];       // [{role, content}] sent with every turn
  var current = null;     // {node, text, toolCalls, started, first, tokens}
  var socket = null;

  function addMessage(role, text) {
    var p = document.createElement("p");
    p.className = "pg-msg " + role;
    var who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : role === "tool" ? "Tool call" : "Error";
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

  function callText(call) {
    var args = call.function.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* shown as it came */ }
    return call.function.name + "(" + args + ")";
  }

  // The boxes' JSON, checked before anything is sent: a typo is said next to the boxes and the
  // message stays in the input (the server checks the shapes again: consumers.py).
  function boxProblem() {
    var boxes = [[schemaBox, "The JSON schema"], [toolsBox, "Tools"]];
    for (var i = 0; i < boxes.length; i++) {
      var text = boxes[i][0].value.trim();
      if (!text) continue;
      try { JSON.parse(text); } catch (e) {
        boxes[i][0].focus();
        return boxes[i][1] + " is not valid JSON (" + e.message + "); nothing was sent.";
      }
    }
    return null;
  }

  function finish() {
    if (current && current.text) history.push({ role: "assistant", content: current.text });
    else if (current && current.toolCalls) {
      // the next turn sees the call as the assistant's text: the chat template needs no tool roles
      history.push({ role: "assistant", content: current.toolCalls.map(callText).join("\n") });
    }
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
      } else if (msg.type === "tool_calls" && current) {
        if (current.first == null) current.first = performance.now();
        current.toolCalls = msg.tool_calls;
        if (!current.text) log.removeChild(current.node.parentNode);  // no text: the calls are the answer
        msg.tool_calls.forEach(function (call) { addMessage("tool", callText(call)); });
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
    var problem = boxProblem();
    boxError.textContent = problem || "";
    boxError.hidden = !problem;
    if (problem) {
      structured.open = true;
      status.textContent = "not sent";
      return;
    }
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
    if (schemaBox.value.trim()) message.json_schema = schemaBox.value;
    if (toolsBox.value.trim()) {
      message.tools = toolsBox.value;
      message.tool_choice = toolChoice.value;
    }
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
