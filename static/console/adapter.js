// Adapter page: upload with a real progress bar (XHR to the REST API, same session + CSRF) and
// live version status. Without JavaScript the form posts to the page itself and works the same.
(function () {
  "use strict";
  var form = document.getElementById("upload-form");
  var csrf = form ? form.querySelector("input[name=csrfmiddlewaretoken]").value : null;

  function showError(message) {
    var box = document.getElementById("upload-error");
    box.textContent = message;  // text, never HTML
    box.hidden = false;
  }

  if (form && window.XMLHttpRequest && window.FormData) {
    form.addEventListener("submit", function (event) {
      var input = form.querySelector("input[type=file]");
      if (!input || !input.files.length) return;  // let the server render its inline error
      event.preventDefault();
      var data = new FormData();
      for (var i = 0; i < input.files.length; i++) data.append("files", input.files[i]);
      var xhr = new XMLHttpRequest();
      var bar = document.getElementById("upload-bar");
      var percent = document.getElementById("upload-percent");
      var button = form.querySelector("button[type=submit]");
      document.getElementById("upload-progress").hidden = false;
      document.getElementById("upload-error").hidden = true;
      button.disabled = true;
      xhr.upload.addEventListener("progress", function (e) {
        if (!e.lengthComputable) return;
        var p = Math.round((100 * e.loaded) / e.total);
        bar.value = p;
        percent.textContent = p + "%";
      });
      xhr.addEventListener("load", function () {
        button.disabled = false;
        if (xhr.status >= 200 && xhr.status < 300) {
          bar.value = 100;
          percent.textContent = "100% · uploaded, validating…";
          window.location.reload();
          return;
        }
        percent.textContent = "sent · refused";
        var message = "Upload failed (HTTP " + xhr.status + ").";
        try {
          var body = JSON.parse(xhr.responseText);
          if (body.detail) message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
        } catch (ignored) { /* not JSON */ }
        showError(message);
      });
      xhr.addEventListener("error", function () {
        button.disabled = false;
        showError("The upload did not reach the server; check the connection and try again.");
      });
      xhr.open("POST", form.dataset.apiUrl);
      xhr.setRequestHeader("X-CSRFToken", csrf);
      xhr.setRequestHeader("Accept", "application/json");
      xhr.send(data);
    });
  }

  // Versions still being validated: poll their status and reload once one settles.
  var table = document.getElementById("versions");
  if (!table || !table.dataset.pending) return;
  var pending = table.dataset.pending.split(",").filter(Boolean);
  var base = table.dataset.statusBase;
  function poll() {
    Promise.all(pending.map(function (n) {
      return fetch(base + n + "/status/", { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; });
    })).then(function (results) {
      var settled = results.some(function (r) { return r && r.status !== "uploaded" && r.status !== "validating"; });
      if (settled) window.location.reload();
      else window.setTimeout(poll, 1000);
    }).catch(function () { window.setTimeout(poll, 3000); });
  }
  window.setTimeout(poll, 1000);
})();
