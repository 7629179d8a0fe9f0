/* chronoq console: auto-refresh. Every N seconds (the header's selector, remembered in this
   browser; ?refresh=N in the address sets it too) the page is fetched again and its <main>
   swapped in place: no full page load, no flash, the scroll position stays. A refresh is put off
   while a form field in the page has the focus, so typing is never lost. */
(function () {
  "use strict";
  var KEY = "chronoq-console-refresh-s";
  var timer = null;
  var every, status;

  function seconds() { return Number(every.value) || 0; }

  function schedule() {
    clearTimeout(timer);
    var s = seconds();
    if (s > 0) { timer = setTimeout(refresh, s * 1000); }
  }

  function typing() {
    var a = document.activeElement;
    return a && /^(INPUT|SELECT|TEXTAREA)$/.test(a.tagName) && document.querySelector("main").contains(a);
  }

  function refresh() {
    if (typing()) { schedule(); return; }
    fetch(location.href, {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (!r.ok) { throw new Error("HTTP " + r.status); }
      return r.text();
    }).then(function (html) {
      var doc = new DOMParser().parseFromString(html, "text/html");
      var fresh = doc.querySelector("main"), old = document.querySelector("main");
      if (!fresh || !old) { throw new Error("no page content"); }
      var open = {};  // <details> the reader opened stay open
      old.querySelectorAll("details[id]").forEach(function (d) { open[d.id] = d.open; });
      fresh.querySelectorAll("details[id]").forEach(function (d) { if (d.id in open) { d.open = open[d.id]; } });
      old.replaceWith(document.adoptNode(fresh));
      var clock = doc.getElementById("clock"), here = document.getElementById("clock");
      if (clock && here) { here.replaceWith(document.adoptNode(clock)); }
      document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
      status.textContent = "";
    }).catch(function (e) {
      status.textContent = "refresh failed: " + e.message;
    }).then(schedule);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var box = document.getElementById("refresh");
    every = document.getElementById("refresh-every");
    status = document.getElementById("refresh-status");
    if (!box || !every) { return; }
    var asked = new URLSearchParams(location.search).get("refresh");
    var chosen = asked !== null ? asked : (localStorage.getItem(KEY) || "0");
    if (!Array.prototype.some.call(every.options, function (o) { return o.value === chosen; }) && Number(chosen) > 0) {
      every.add(new Option(chosen + " s", chosen));
    }
    every.value = chosen;
    if (every.value !== chosen) { every.value = "0"; }
    every.addEventListener("change", function () { localStorage.setItem(KEY, every.value); schedule(); });
    box.hidden = false;
    schedule();
  });
})();
