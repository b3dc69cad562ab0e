// tokenline live pipeline page: reads GET /v1/events (server-sent events) with fetch, so the API key
// can go in an Authorization header (EventSource cannot send one), and draws it with uPlot.
"use strict";
(function () {
  const KEY_STORE = "tokenline.apiKey"; // sessionStorage: the key lives only as long as this tab
  const MAX_POINTS = 1500; // per chart series: bounded however long the page stays open
  const MAX_REQUESTS = 300; // requests remembered for the waterfall and latency charts
  const WATERFALL_ROWS = 80;
  const REDRAW_MS = 500;

  const $ = (id) => document.getElementById(id);
  const state = {
    hello: null, steps: 0, requests: 0, finished: 0, cancelled: 0, dropped: 0, dirty: false,
    load: [[], [], []], // wall time, waiting, running
    comp: [[], [], [], [], []], // wall time, prefill tokens, decode tokens, sequences, preemptions
    kv: [[], [], [], [], []], // wall time, blocks used, blocks total, state slots used, slots total
    tput: new Map(), // wall second -> [prefill tokens, decode tokens]
    lat: [[], [], []], // finish wall time, TTFT ms, TPOT ms
    reqs: new Map(), // tenant/request id -> lifecycle
    spend: new Map(), // tenant -> {n, in, out, usd}
  };
  window.tokenlineDashboard = state; // for the console (and tests)

  const wall = (t) => state.hello.wall + (t - state.hello.now);
  function push(cols, values) {
    values.forEach((v, i) => cols[i].push(v));
    if (cols[0].length > MAX_POINTS) cols.forEach((c) => c.splice(0, c.length - MAX_POINTS));
  }
  function count(id, value) { const el = $(id); el.textContent = value; el.dataset.value = value; }
  function setStatus(text, kind) { const el = $("status"); el.textContent = text; el.dataset.state = kind; }

  // --- events ----------------------------------------------------------------------------------
  const handlers = {
    hello(d) { state.hello = d; $("scope").textContent = d.scope === "all" ? "all tenants" : (d.tenant || "own"); },
    step(d) {
      const x = wall(d.t);
      state.steps += 1;
      push(state.load, [x, d.num_waiting, d.num_running]);
      push(state.comp, [x, d.num_prefill_tokens, d.num_decode_tokens, d.num_seqs, d.num_preemptions]);
      push(state.kv, [x, d.num_kv_blocks_used, d.num_kv_blocks, d.num_state_slots_used, d.num_state_slots]);
      const sec = Math.floor(x);
      const b = state.tput.get(sec) || [0, 0];
      b[0] += d.num_prefill_tokens; b[1] += d.num_decode_tokens;
      state.tput.set(sec, b);
      if (state.tput.size > 600) state.tput.delete(state.tput.keys().next().value);
    },
    stats(d) {
      const x = wall(d.t);
      push(state.load, [x, d.num_waiting, d.num_running]);
      push(state.kv, [x, d.num_kv_blocks_used, d.num_kv_blocks, d.num_state_slots_used, d.num_state_slots]);
      $("now-running").textContent = d.num_running;
      $("now-waiting").textContent = d.num_waiting;
      $("now-kv").textContent = d.num_kv_blocks_used + " / " + d.num_kv_blocks;
      $("now-slots").textContent = d.num_state_slots_used + " / " + d.num_state_slots;
      $("slots-counter").hidden = !d.num_state_slots;
    },
    request(d) {
      const id = (d.tenant || "") + "/" + d.request_id;
      let r = state.reqs.get(id);
      if (!r) {
        r = { id: d.request_id, tenant: d.tenant, arrived: d.arrived, stamps: {}, status: null };
        state.reqs.set(id, r);
        state.requests += 1;
        if (state.reqs.size > MAX_REQUESTS) state.reqs.delete(state.reqs.keys().next().value);
      }
      r.stamps[d.stage] = d.t;
      if (d.stage !== "finished") return;
      r.status = d.status;
      r.stages = d.stages_s || {};
      if (d.status === "finished") state.finished += 1; else if (d.status === "cancelled" || d.status === "timed_out") state.cancelled += 1;
      const s = r.stages;
      if (s.first_token !== undefined) {
        const tpot = d.completion_tokens > 1 && s.last_token !== undefined
          ? 1000 * (s.last_token - s.first_token) / (d.completion_tokens - 1) : null;
        push(state.lat, [wall(d.t), 1000 * s.first_token, tpot]);
      }
      const tenant = d.tenant || "anonymous";
      const sp = state.spend.get(tenant) || { n: 0, in: 0, out: 0, usd: 0 };
      sp.n += 1; sp.in += d.prompt_tokens || 0; sp.out += d.completion_tokens || 0; sp.usd += d.cost_usd || 0;
      state.spend.set(tenant, sp);
    },
    dropped(d) { state.dropped += d.dropped; },
  };

  function dispatch(type, data) {
    const handler = handlers[type];
    if (!handler || (!state.hello && type !== "hello")) return;
    handler(JSON.parse(data));
    state.dirty = true;
  }

  // --- the stream ------------------------------------------------------------------------------
  let controller = null;
  async function connect() {
    if (controller) controller.abort();
    controller = new AbortController();
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    setStatus("connecting…", "idle");
    let resp;
    try {
      resp = await fetch("/v1/events", { headers, signal: controller.signal, cache: "no-store" });
    } catch (e) {
      if (e.name !== "AbortError") retry("connection failed");
      return;
    }
    if (!resp.ok) {
      let message = resp.status + "";
      try { message += ": " + (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      setStatus(resp.status === 401 || resp.status === 403 ? "enter an API key (" + message + ")" : message, "error");
      if (resp.status !== 401 && resp.status !== 403) retry(message);
      return;
    }
    setStatus("live", "live");
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let type = "message", data = "";
          for (const line of frame.split("\n")) {
            if (line.startsWith("event: ")) type = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (data) dispatch(type, data);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") return;
    }
    retry("stream ended");
  }
  function retry(why) {
    setStatus(why + "; reconnecting…", "error");
    setTimeout(connect, 2000);
  }

  $("key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    connect();
  });

  // --- drawing ---------------------------------------------------------------------------------
  const charts = {};
  function chart(id, series, data) {
    if (!charts[id]) {
      const el = $(id);
      charts[id] = new uPlot({
        width: Math.max(300, el.clientWidth), height: 200,
        series: [{}, ...series.map(([label, stroke, extra]) => Object.assign({ label, stroke, width: 1.5 }, extra || {}))],
        axes: [{}, { size: 50 }],
      }, data, el);
    } else {
      charts[id].setData(data);
    }
  }
  function throughputData() {
    const secs = [...state.tput.keys()].sort((a, b) => a - b).slice(0, -1); // the current second is partial
    return [secs, secs.map((s) => state.tput.get(s)[0]), secs.map((s) => state.tput.get(s)[1])];
  }
  const dot = { points: { show: true, size: 4 } };
  const scatter = { points: { show: true, size: 6 }, paths: () => null }; // one point per request, unjoined

  function drawWaterfall() {
    const rows = [...state.reqs.values()].slice(-WATERFALL_ROWS);
    const box = $("waterfall");
    if (!rows.length) { box.textContent = ""; return; }
    const lastT = Math.max(...rows.map((r) => Math.max(...Object.values(r.stamps))));
    const t0 = Math.min(...rows.map((r) => r.arrived));
    const span = Math.max(lastT - t0, 0.001);
    const pct = (t) => (100 * (t - t0) / span).toFixed(3) + "%";
    const html = rows.map((r) => {
      const s = r.stamps, st = r.stages || {};
      const at = (name) => (st[name] !== undefined ? r.arrived + st[name] : s[name]);
      const end = s.finished !== undefined ? s.finished : lastT;
      const queued = at("queued"), scheduled = at("first_scheduled"), first = at("first_token");
      const segs = [];
      const seg = (cls, a, b) => { if (a !== undefined && b !== undefined && b >= a) segs.push(`<i class="seg ${cls}" style="left:${pct(a)};width:calc(${pct(b)} - ${pct(a)} + 1px)"></i>`); };
      seg("gateway", r.arrived, queued !== undefined ? queued : end);
      seg("queue", queued, scheduled !== undefined ? scheduled : (first !== undefined ? first : end));
      seg("prefill", scheduled, first !== undefined ? first : (scheduled !== undefined ? end : undefined));
      seg("decode", first, end);
      if (r.status === "cancelled" || r.status === "timed_out") segs.push(`<i class="seg cancelled" style="left:${pct(end)}"></i>`);
      const label = (r.tenant ? r.tenant + " · " : "") + r.id;
      return `<div class="wf-row" data-request-id="${escape(r.id)}" data-status="${r.status || "running"}">` +
        `<span class="wf-label" title="${escape(label)}">${escape(label)}</span><span class="wf-track">${segs.join("")}</span></div>`;
    });
    box.innerHTML = html.join("");
  }
  function escape(text) {
    return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function drawSpend() {
    const body = $("spend").tBodies[0];
    body.innerHTML = [...state.spend.entries()].map(([t, s]) =>
      `<tr data-tenant="${escape(t)}"><td>${escape(t)}</td><td>${s.n}</td><td>${s.in}</td><td>${s.out}</td><td>${s.usd.toFixed(6)}</td></tr>`).join("");
  }

  function redraw() {
    if (!state.dirty || !state.hello) return;
    state.dirty = false;
    count("count-steps", state.steps);
    count("count-requests", state.requests);
    count("count-finished", state.finished);
    count("count-cancelled", state.cancelled);
    count("count-dropped", state.dropped);
    chart("chart-load", [["waiting", "#f0b429"], ["running", "#2680c2"]], state.load);
    chart("chart-steps", [["prefill tokens", "#e12d39", dot], ["decode tokens", "#2680c2", dot], ["sequences", "#3ebd93"], ["preemptions", "#000", scatter]], state.comp);
    chart("chart-kv", [["KV blocks used", "#8719e0"], ["KV blocks", "#bbb"], ["state slots used", "#3ebd93"], ["state slots", "#ddd"]], state.kv);
    chart("chart-throughput", [["prefill tok/s", "#e12d39"], ["decode tok/s", "#2680c2"]], throughputData());
    chart("chart-latency", [["TTFT ms", "#f0b429", scatter], ["TPOT ms", "#2680c2", scatter]], state.lat);
    drawWaterfall();
    drawSpend();
  }
  setInterval(redraw, REDRAW_MS);
  connect();
})();
