// nsqadmin's only script (no build step): confirm() before destructive actions, and the
// page's main part fetched again every data-refresh seconds (skipped while typing).
(function () {
  "use strict";
  document.addEventListener("submit", function (ev) {
    var text = ev.target.getAttribute("data-confirm");
    if (text && !window.confirm(text)) { ev.preventDefault(); }
  }, true);
  var every = parseFloat(document.body.getAttribute("data-refresh") || "0");
  var main = document.getElementById("main");
  if (!every || !main) { return; }
  function busy() {
    var a = document.activeElement;
    return document.hidden || (a && (a.tagName === "INPUT" || a.tagName === "SELECT"));
  }
  function refresh() {
    if (busy()) { return; }
    fetch(window.location.href, {headers: {"X-Nsqadmin-Fragment": "1"},
                                 credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null && !busy()) {
          main.innerHTML = html;
          document.body.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { /* the next tick tries again */ });
  }
  window.setInterval(refresh, every * 1000);
}());
