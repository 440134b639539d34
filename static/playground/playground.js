// The playground: one websocket per page, one chat at a time, streamed to one model or to up to
// three side by side (a column each: its own Stop, timings, status and errors; consumers.py).
// Model output is only ever put into the page as text (textContent / createTextNode), never
// parsed as HTML.
(function () {
  "use strict";
  var root = document.getElementById("playground");
  if (!root) return;
  var form = document.getElementById("pg-form");
  var columnsBox = document.getElementById("pg-columns");
  var input = document.getElementById("pg-input");
  var modelSelects = [document.getElementById("pg-model"), document.getElementById("pg-model-2"),
                      document.getElementById("pg-model-3")];
  var maxTokens = document.getElementById("pg-max-tokens");
  var temperature = document.getElementById("pg-temperature");
  var schemaBox = document.getElementById("pg-schema");
  var toolsBox = document.getElementById("pg-tools");
  var toolChoice = document.getElementById("pg-tool-choice");
  var boxError = document.getElementById("pg-box-error");
  var modelsError = document.getElementById("pg-models-error");
  var structured = document.getElementById("pg-structured");
  var send = document.getElementById("pg-send");
  var stop = document.getElementById("pg-stop");
  var clear = document.getElementById("pg-clear");
  var stats = document.getElementById("pg-stats");
  var status = document.getElementById("pg-status");
  var canSend = !send.disabled;

  var history = [];       // one model: [{role, content}] sent with every turn
  var columns = [];       // [{index, root, log, label, status, stats, stop, current, ended}]
  var layout = null;      // the models of the columns shown, joined: a new comparison when it changes
  var socket = null;

  // Column 0 is in the page (#pg-log inside it); the others are copies of it.
  function makeColumn(index) {
    var node = index === 0 ? columnsBox.querySelector(".pg-column") : columns[0].root.cloneNode(true);
    if (index > 0) {
      var log = node.querySelector(".pg-log");
      log.removeAttribute("id");
      while (log.firstChild) log.removeChild(log.firstChild);
      columnsBox.appendChild(node);
    }
    node.dataset.column = String(index);
    var column = {
      index: index, root: node, log: node.querySelector(".pg-log"), label: node.querySelector(".pg-col-model"),
      status: node.querySelector(".pg-col-status"), stats: node.querySelector(".pg-col-stats"),
      stop: node.querySelector(".pg-col-stop"), current: null,
    };
    column.stats.textContent = "";
    column.status.textContent = "";
    column.stop.disabled = true;
    column.stop.addEventListener("click", function () {
      if (socket && column.current) socket.send(JSON.stringify({ type: "cancel", column: column.index }));
    });
    return column;
  }
  columns.push(makeColumn(0));

  function chosenModels() {
    var models = [];
    modelSelects.forEach(function (select) { if (select && select.value) models.push(select.value); });
    return models;
  }

  // Show one column per model. A different set of compared models starts a new comparison
  // (the logs are cleared); one model keeps its conversation when the model changes, as before.
  function arrange(models) {
    var key = models.join("\n");
    if (key !== layout && (models.length > 1 || columns.length > 1)) {
      while (columns.length > 1) columnsBox.removeChild(columns.pop().root);
      clearLog(columns[0]);
      history = [];
      for (var i = 1; i < models.length; i++) columns.push(makeColumn(i));
    }
    layout = key;
    columnsBox.className = "pg-columns " + (models.length > 1 ? "side-by-side cols-" + models.length : "single");
    columns.forEach(function (column, i) { column.label.textContent = models[i]; });
  }

  function clearLog(column) {
    while (column.log.firstChild) column.log.removeChild(column.log.firstChild);
    column.stats.textContent = "";
    column.status.textContent = "";
  }

  function addMessage(column, role, text) {
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
    column.log.appendChild(p);
    column.log.scrollTop = column.log.scrollHeight;
    return body;
  }

  // Thumbs up/down under an answer, for its completion id (recorded as the tenant's feedback).
  function addRating(column, message, completionId) {
    if (!completionId || !message || !message.parentNode) return;
    var box = document.createElement("span");
    box.className = "pg-rate";
    box.dataset.completionId = completionId;
    // words, not emoji: a browser without an emoji font draws those as empty boxes
    [["up", "Good", "Good answer"], ["down", "Bad", "Bad answer"]].forEach(function (spec) {
      var button = document.createElement("button");
      button.type = "button";
      button.className = "pg-thumb " + spec[0];
      button.dataset.rating = spec[0];
      button.textContent = spec[1];
      button.title = spec[2];
      button.setAttribute("aria-label", spec[2]);
      button.setAttribute("aria-pressed", "false");
      button.addEventListener("click", function () {
        if (socket && socket.readyState === WebSocket.OPEN) {
          socket.send(JSON.stringify({ type: "feedback", completion_id: completionId, rating: spec[0] }));
        }
      });
      box.appendChild(button);
    });
    message.appendChild(box);
  }

  function running() {
    return columns.some(function (column) { return column.current; });
  }

  function busy() {
    var any = running();
    send.disabled = any || !canSend || !socket || socket.readyState !== WebSocket.OPEN;
    stop.disabled = !any;
    columns.forEach(function (column) { column.stop.disabled = !column.current; });
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

  function modelsProblem(models) {
    for (var i = 0; i < models.length; i++) {
      if (models.indexOf(models[i]) !== i) return models[i] + " is chosen twice; compare different models.";
    }
    return models.length ? null : "Choose a model.";
  }

  // The column's answer ended (done, stopped, failed): `state` is what its status says.
  function finish(column, state, completionId) {
    var current = column.current;
    if (!current) return;
    column.current = null;
    column.status.textContent = state;
    if (columns.length === 1) {
      if (current.text) history.push({ role: "assistant", content: current.text });
      else if (current.toolCalls) {
        // the next turn sees the call as the assistant's text: the chat template needs no tool roles
        history.push({ role: "assistant", content: current.toolCalls.map(callText).join("\n") });
      } else if (state === "error") history.pop();  // the turn that failed
    }
    addRating(column, current.text || !current.toolCalls ? current.node.parentNode : current.lastTool, completionId);
    busy();
    if (!running()) {
      status.textContent = columns.length === 1 ? state : "done";
      if (columns.length === 1) stats.textContent = column.stats.textContent;
    }
  }

  function statsText(ttftMs, tokensPerSecond) {
    var parts = [];
    if (ttftMs != null) parts.push("time to first token " + Math.round(ttftMs) + " ms");
    if (tokensPerSecond != null) parts.push(tokensPerSecond.toFixed(1) + " tokens/s");
    return parts.join(" · ");
  }

  function showStats(column, text) {
    column.stats.textContent = text;
    if (columns.length === 1) stats.textContent = text;
  }

  function liveStats(column) {
    var current = column.current;
    if (!current || current.first == null) return;
    var seconds = (performance.now() - current.first) / 1000;
    showStats(column, statsText(current.first - current.started,
                                seconds > 0 && current.tokens > 1 ? (current.tokens - 1) / seconds : null));
  }

  function onFeedback(msg) {
    var box = columnsBox.querySelector('.pg-rate[data-completion-id="' + CSS.escape(msg.completion_id) + '"]');
    if (!box) return;
    box.querySelectorAll(".pg-thumb").forEach(function (button) {
      var chosen = !msg.error && button.dataset.rating === msg.rating;
      button.setAttribute("aria-pressed", chosen ? "true" : "false");
      button.classList.toggle("chosen", chosen);
    });
    box.title = msg.error ? msg.error : "Thanks: recorded as " + (msg.rating === "up" ? "a good" : "a bad") + " answer.";
    status.textContent = msg.error ? "feedback not recorded: " + msg.error : "feedback recorded";
  }

  function onMessage(msg) {
    if (msg.type === "feedback") { onFeedback(msg); return; }
    if (msg.type === "error" && msg.completion_id) { onFeedback({ completion_id: msg.completion_id, error: msg.message }); return; }
    if (msg.type === "error" && msg.column == null) {
      // the whole chat was refused before any column started: said once, in the first column
      addMessage(columns[0], "error", msg.message || "error");
      columns.forEach(function (column) {
        if (column.current && !column.current.text) column.log.removeChild(column.current.node.parentNode);
        finish(column, "error");
      });
      status.textContent = "error";
      return;
    }
    var column = columns[msg.column];
    if (!column) return;
    var current = column.current;
    if (msg.type === "delta" && current) {
      if (current.first == null) current.first = performance.now();
      current.text += msg.text;
      current.tokens += 1;
      current.node.textContent = current.text;
      column.log.scrollTop = column.log.scrollHeight;
      liveStats(column);
    } else if (msg.type === "tool_calls" && current) {
      if (current.first == null) current.first = performance.now();
      current.toolCalls = msg.tool_calls;
      if (!current.text) column.log.removeChild(current.node.parentNode);  // no text: the calls are the answer
      msg.tool_calls.forEach(function (call) {
        current.lastTool = addMessage(column, "tool", callText(call)).parentNode;
      });
    } else if (msg.type === "usage" && current) {
      current.tokens = msg.completion_tokens || current.tokens;
    } else if (msg.type === "done") {
      showStats(column, statsText(msg.ttft_ms, msg.tokens_per_second));
      finish(column, msg.finish_reason === "length" ? "done (max tokens reached)" : "done", msg.completion_id);
    } else if (msg.type === "cancelled") {
      finish(column, "stopped", msg.completion_id);
    } else if (msg.type === "error") {
      addMessage(column, "error", msg.message || "error");
      if (current && !current.text) column.log.removeChild(current.node.parentNode);
      finish(column, "error");
    }
  }

  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + root.dataset.wsPath);
    socket.onopen = function () { status.textContent = "connected"; busy(); };
    socket.onclose = function () {
      columns.forEach(function (column) { finish(column, "disconnected"); });
      status.textContent = "disconnected — reload the page to reconnect";
      busy();
    };
    socket.onmessage = function (event) {
      var msg;
      try { msg = JSON.parse(event.data); } catch (e) { return; }
      onMessage(msg);
    };
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    var text = input.value.trim();
    if (!text || running() || !socket || socket.readyState !== WebSocket.OPEN) return;
    var models = chosenModels();
    var problem = boxProblem();
    boxError.textContent = problem || "";
    boxError.hidden = !problem;
    var modelProblem = problem ? null : modelsProblem(models);
    modelsError.textContent = modelProblem || "";
    modelsError.hidden = !modelProblem;
    if (problem || modelProblem) {
      if (problem) structured.open = true;
      status.textContent = "not sent";
      return;
    }
    arrange(models);
    // One model: the conversation goes on. Side by side: each prompt is answered on its own,
    // so that every column answers the same messages.
    var messages = models.length === 1 ? history : [];
    messages.push({ role: "user", content: text });
    if (models.length === 1) history = messages;
    input.value = "";
    columns.forEach(function (column) {
      addMessage(column, "user", text);
      column.current = { node: addMessage(column, "assistant", ""), text: "", started: performance.now(), first: null,
                         tokens: 0 };
      column.stats.textContent = "";
      column.status.textContent = "generating…";
    });
    stats.textContent = "";
    status.textContent = "generating…";
    busy();
    var message = { type: "chat", messages: messages.slice() };
    if (models.length === 1) message.model = models[0];
    else message.models = models;
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
    if (socket && running()) socket.send(JSON.stringify({ type: "cancel" }));
  });

  clear.addEventListener("click", function () {
    if (running()) return;
    history = [];
    columns.forEach(clearLog);
    stats.textContent = "";
  });

  busy();
  connect();
})();
