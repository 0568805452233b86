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

  // The overview: a snapshot from /api/status (status.Read) every refresh-ms, and how old it is.
  const freshness = document.getElementById("freshness");
  if (freshness && document.getElementById("shards")) {
    const refreshMs = Number(meta("refresh-ms")) || 2000;
    let last = null; // { report, fetchedAt }
    let failure = "";

    const set = (id, value) => {
      const node = document.getElementById(id);
      if (node) node.textContent = visible(value);
    };
    const cell = (value) => el("td", value);
    const linkCell = (value, href) => {
      const td = document.createElement("td");
      const a = el("a", value);
      a.href = href; // Always a path of the console, its variable part encoded.
      td.appendChild(a);
      return td;
    };
    const fill = (id, rows, cells, columns) => {
      const tbody = document.querySelector(`#${id} tbody`);
      const out = [];
      for (const row of rows || []) {
        const tr = document.createElement("tr");
        for (const td of cells(row)) tr.appendChild(td);
        out.push(tr);
      }
      if (out.length === 0) {
        const tr = document.createElement("tr");
        const td = el("td", "none", "muted");
        td.colSpan = columns;
        tr.appendChild(td);
        out.push(tr);
      }
      tbody.replaceChildren(...out);
    };
    // A time of the report relative to its snapshot, both by the database clock.
    const relative = (iso, at) => {
      if (!iso) return "—";
      const s = (Date.parse(iso) - Date.parse(at)) / 1000;
      return s >= 0 ? "in " + age(s) : age(-s) + " ago";
    };
    const calls = (key) => "/calls?key=" + encodeURIComponent(key);

    const render = (r) => {
      const shards = (r.outbox && r.outbox.shards) || [];
      set("outbox-pending", r.outbox.pending);
      set("outbox-oldest", r.outbox.pending > 0 ? age(r.outbox.oldest_pending_seconds) : "—");
      for (const d of r.dead_letters || []) {
        if (d.source !== "inbox" && d.source !== "relay") continue;
        set(`dlq-${d.source}-count`, d.count);
        set(`dlq-${d.source}-oldest`, d.count > 0 ? age(d.oldest_age_seconds) : "—");
      }
      set("relays-live", (r.relays || []).filter((n) => n.live).length);
      set("shards-unowned", shards.filter((s) => !s.owner).length);
      set("calls-failing", ((r.calls && r.calls.failing) || []).length);
      set("window", age(r.window_seconds));

      fill("shards", shards.filter((s) => s.messages + s.calls > 0 || !s.owner), (s) => [
        linkCell(s.shard, "/outbox?shard=" + encodeURIComponent(s.shard)),
        s.owner ? cell(s.owner) : el("td", "none: nothing publishes it", "warn"),
        cell(s.messages), cell(s.calls), cell(s.failing),
        cell(s.messages + s.calls > 0 ? age(s.oldest_pending_seconds) : "—"),
      ], 6);
      fill("leases", r.leases, (l) => [
        cell(l.shard), cell(l.owner || "—"), cell(l.token),
        l.expired ? el("td", "expired", "warn") : cell(relative(l.expires_at, r.at)),
      ], 4);
      fill("relays", r.relays, (n) => [
        cell(n.owner), n.live ? cell("live") : el("td", "gone", "warn"), cell(relative(n.expires_at, r.at)),
      ], 3);
      fill("dedup", r.dedup, (d) => [
        cell(d.consumer), cell(d.handler || "—"), cell(d.checks), cell(d.hits),
        cell((100 * d.hit_rate).toFixed(2) + " %"), cell(relative(d.since, r.at)),
      ], 6);
      const c = r.calls || {};
      fill("calls-retrying", c.failing, (f) => [
        linkCell(f.id, "/outbox/" + encodeURIComponent(f.id)), cell(f.idempotency_key), cell(f.attempts),
        cell(f.next_attempt_at ? relative(f.next_attempt_at, r.at) : "due"), cell(f.last_error),
      ], 5);
      fill("calls-unsuccessful", c.unsuccessful, (u) => [
        linkCell(u.idempotency_key, calls(u.idempotency_key)), cell(u.outcome), cell(u.http_status), cell(u.object_id || "—"),
        cell(relative(u.completed_at, r.at)),
      ], 5);
      fill("calls-dead", c.dead_letters, (d) => [
        linkCell(d.id, "/letters/" + encodeURIComponent(d.id)), linkCell(d.idempotency_key, calls(d.idempotency_key)),
        cell(d.reason), cell(d.error), cell(relative(d.first_failed_at, r.at)),
      ], 5);
      fill("figures", r.freshness, (f) => [cell(f.figure), cell(f.age_seconds > 0 ? age(f.age_seconds) : "—"), cell(f.note)], 3);
    };

    const showFreshness = () => {
      if (!last) {
        freshness.textContent = failure ? "No snapshot yet: " + visible(failure) : "Loading the first snapshot…";
        freshness.className = failure ? "stale" : "muted";
        return;
      }
      const since = (Date.now() - last.fetchedAt) / 1000;
      const at = String(last.report.at).replace("T", " ").replace(/\.\d+/, "");
      let msg = `Snapshot as of ${visible(at)} (database clock), fetched ${age(since)} ago; refreshed every ${age(refreshMs / 1000)}.`;
      if (failure) msg += " Refreshing fails: " + visible(failure);
      freshness.textContent = msg;
      freshness.className = failure || since * 1000 > 3 * refreshMs ? "stale" : "muted";
    };

    const tick = async () => {
      try {
        const res = await fetch("/api/status", { headers: { Accept: "application/json" } });
        const body = await res.json();
        if (!res.ok) throw new Error(body.error || res.statusText);
        last = { report: body, fetchedAt: Date.now() };
        failure = "";
        render(body);
      } catch (e) {
        failure = String(e.message || e);
      }
      showFreshness();
      setTimeout(tick, refreshMs);
    };
    setInterval(showFreshness, 1000);
    tick();
  }
})();
