// The console's only script: confirmation of destructive forms, live progress of a redrive and the
// live overview. It builds the page from JSON with textContent only: nothing it receives is ever
// parsed as markup.
"use strict";

(function () {
  const meta = (name) => (document.querySelector(`meta[name="${name}"]`) || {}).content || "";

  // Stored text made visible, as the server's pages show it: control and format characters (terminal
  // escapes, bidi overrides, zero-width marks) as \x.. or \u.... escapes.
  const visible = (s) =>
    String(s).replace(/[\p{Cc}\p{Cf}]/gu, (c) => {
      const n = c.codePointAt(0);
      if (c === "\t") return "\\t";
      if (c === "\n") return "\\n";
      if (c === "\r") return "\\r";
      return n < 0x80 ? "\\x" + n.toString(16).padStart(2, "0") : "\\u" + n.toString(16).padStart(4, "0");
    });

  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = visible(text);
    if (cls) e.className = cls;
    return e;
  };

  const age = (seconds) => {
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m";
    if (s < 86400) return Math.floor(s / 3600) + "h" + (Math.floor(s / 60) % 60) + "m";
    return Math.floor(s / 86400) + "d" + (Math.floor(s / 3600) % 24) + "h";
  };

  // Forms that destroy or move something ask first.
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (ev) => {
      if (!window.confirm(form.dataset.confirm)) ev.preventDefault();
    });
  });

  // A running redrive's page follows its progress.
  const redrive = document.getElementById("redrive");
  if (redrive && redrive.dataset.state === "running") {
    const id = redrive.dataset.redrive;
    const tick = async () => {
      let st;
      try {
        const res = await fetch(`/api/redrives/${encodeURIComponent(id)}`, { headers: { Accept: "application/json" } });
        if (!res.ok) throw new Error(res.statusText);
        st = await res.json();
      } catch (e) {
        setTimeout(tick, 1000);
        return;
      }
      document.getElementById("redrive-state").textContent = visible(st.state);
      document.getElementById("redrive-moved").textContent = st.moved;
      document.getElementById("redrive-released").textContent = st.released;
      document.getElementById("redrive-elapsed").textContent = st.elapsed_seconds.toFixed(1) + " s";
      const bar = document.getElementById("redrive-progress");
      bar.max = st.planned;
      bar.value = st.moved;
      if (st.error) {
        const err = document.getElementById("redrive-error");
        err.textContent = visible(st.error);
        err.hidden = false;
      }
      redrive.dataset.state = st.state;
      if (st.state === "running") {
        setTimeout(tick, 500);
      } else {
        const stop = document.getElementById("stop-form");
        if (stop) stop.hidden = true;
      }
    };
    setTimeout(tick, 300);
  }

  window.txboxConsole = { visible, el, age, meta };
})();
