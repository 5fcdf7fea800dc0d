// iop status page: polls ./state every 1.5 s and redraws. No framework, no
// build step; everything is built with textContent (never innerHTML), so no
// value from the Edge is ever parsed as markup.
"use strict";

(function () {
  const POLL_MS = 1500;
  const KEY_STORAGE = "iop.apiKey";
  const $ = (id) => document.getElementById(id);
  let timer = null;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function age(seconds) {
    let s = Math.max(0, Math.floor(seconds));
    if (s < 60) return s + "s";
    let m = Math.floor(s / 60); s %= 60;
    if (m < 60) return m + "m " + String(s).padStart(2, "0") + "s";
    let h = Math.floor(m / 60); m %= 60;
    if (h < 24) return h + "h " + String(m).padStart(2, "0") + "m";
    const d = Math.floor(h / 24); h %= 24;
    return d + "d " + h + "h";
  }

  function duration(seconds) {
    return seconds < 10 ? seconds.toFixed(1) + "s" : age(seconds);
  }

  // In a cluster, a node connected to another Edge is not offline: this
  // Edge forwards its work there (status.nodes[].edge names that Edge).
  function heldElsewhere(node, me) {
    return !node.connected && Boolean(node.edge) && node.edge !== me;
  }

  function nodeState(node, me) {
    if (!node.connected) return heldElsewhere(node, me) ? "elsewhere" : "offline";
    return node.draining ? "draining" : "ready";
  }

  function nodeMeta(node, now, me) {
    const parts = [];
    if (heldElsewhere(node, me)) {
      parts.push("connected to Edge " + node.edge);
    } else if (node.connected) {
      if (node.generation !== undefined) parts.push("generation " + node.generation);
      if (node.connected_since !== undefined) parts.push("up " + age(now - node.connected_since));
    } else if (node.last_seen !== undefined) {
      parts.push("last seen " + age(now - node.last_seen) + " ago");
    } else {
      parts.push("never connected");
    }
    parts.push((node.in_flight || 0) + " in flight");
    return parts.join(" · ");
  }

  function capacityRow(provider, klass, nodeId) {
    const used = provider.in_use[klass] || 0;
    const capacity = provider.capacity[klass] || 0;
    const share = capacity ? Math.min(100, (100 * used) / capacity) : 0;
    const fill = el("span");
    fill.style.width = share + "%";
    const bar = el("div", {
      class: "bar " + klass + (capacity && used >= capacity ? " full" : ""),
      role: "progressbar",
      "aria-valuemin": 0,
      "aria-valuemax": capacity,
      "aria-valuenow": used,
      "aria-label": `${nodeId} ${provider.id}: ${klass} leases in use`,
    }, fill);
    return el("div", { class: "cap" },
      el("span", { class: "cap-label", text: klass }),
      bar,
      el("span", { class: "cap-num" },
        el("span", { "data-in-use": klass, text: used }), "/", el("span", { "data-capacity": klass, text: capacity })));
  }

  function providerItem(provider, nodeId) {
    const health = provider.health || "unknown";
    const head = el("div", { class: "provider-head" },
      el("span", { class: "name", text: provider.id }),
      el("span", { class: "badge " + health, text: health }),
      provider.ejected ? el("span", { class: "badge ejected", text: "ejected" }) : null,
      el("span", { class: "status", text: `${provider.status} · ${provider.adapter}` }));
    return el("li", { class: "provider", "data-provider": `${nodeId}/${provider.id}` },
      head, capacityRow(provider, "normal", nodeId), capacityRow(provider, "long", nodeId));
  }

  function nodeCard(node, now, me) {
    const state = nodeState(node, me);
    const adapters = (node.adapters || []).map((a) => `${a.name} (${a.type})`).join(", ");
    return el("article", { class: "node", "data-node": node.id, "data-state": state, "aria-label": `node ${node.id}, ${state}` },
      el("header", {}, el("h3", { text: node.id }), el("span", { class: "badge " + state, text: state })),
      el("p", { class: "meta", text: nodeMeta(node, now, me) }),
      adapters ? el("p", { class: "adapters", text: "adapters: " + adapters }) : null,
      el("ul", { class: "providers", "aria-label": `providers of ${node.id}` },
        ...(node.providers || []).map((p) => providerItem(p, node.id))));
  }

  function fillTable(id, rows, empty, columns) {
    const body = $(id).querySelector("tbody");
    body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: columns, class: "empty", text: empty }))]));
  }

  function tokens(usage) {
    if (!usage) return "";
    return `${usage.input_tokens ?? 0} / ${usage.output_tokens ?? 0}`;
  }

  function runRow(run, now) {
    const target = [run.adapter, run.target].filter(Boolean).join(" · ");
    const end = run.ended_at ?? now;
    const status = run.error ? `${run.status}: ${run.error}` : run.status;
    return el("tr", { "data-run": run.id },
      el("td", { class: "id", text: run.id }),
      el("td", { text: run.node || "" }),
      el("td", { text: target }),
      el("td", {}, el("span", { class: "badge " + run.status, text: status })),
      el("td", { class: "num", text: run.started_at !== undefined ? duration(end - run.started_at) : "" }),
      el("td", { class: "num", text: tokens(run.usage) }));
  }

  function draw(data) {
    const status = data.status;
    const now = data.now;
    const nodes = status.nodes || [];
    const groups = status.model_groups || [];
    // Work waiting for an adapter or node named directly has its own lines.
    const lines = groups.concat(status.direct_queues || []);
    const me = status.cluster ? status.cluster.edge_id : null;
    let used = 0, capacity = 0;
    for (const node of nodes) {
      for (const p of node.providers || []) {
        used += (p.in_use.normal || 0) + (p.in_use.long || 0);
        capacity += (p.capacity.normal || 0) + (p.capacity.long || 0);
      }
    }
    const ready = nodes.filter((n) => n.connected || heldElsewhere(n, me));
    $("sum-nodes").textContent = `${ready.length} / ${nodes.length}`;
    $("sum-inflight").textContent = nodes.reduce((sum, n) => sum + (n.in_flight || 0), 0);
    $("sum-leases").textContent = `${used} / ${capacity}`;
    $("sum-queued").textContent = lines.reduce((sum, g) => sum + (g.queued || 0), 0);

    const cards = nodes.map((n) => nodeCard(n, now, me));
    $("nodes").replaceChildren(...(cards.length ? cards : [el("p", { class: "empty", text: "No nodes are configured." })]));
    fillTable("groups", lines.map((g) => el("tr", { "data-group": g.name },
      el("td", { text: g.name }), el("td", { class: "num", text: g.queued }))), "No model groups.", 2);
    fillTable("runs", (data.runs || []).map((r) => runRow(r, now)), "No runs since the Edge started.", 6);
  }

  function live(state, text) {
    $("live").dataset.state = state;
    $("live-text").textContent = text;
  }

  function showKeyForm(show, hint) {
    $("key-form").hidden = !show;
    $("key-button").setAttribute("aria-expanded", String(show));
    if (hint) $("key-hint").textContent = hint;
    if (show) $("key-input").focus();
  }

  async function poll() {
    timer = null;
    const headers = { accept: "application/json" };
    const key = localStorage.getItem(KEY_STORAGE);
    if (key) headers.authorization = "Bearer " + key;
    try {
      const response = await fetch("state", { headers, cache: "no-store" });
      if (response.status === 401) {
        live("error", "A caller key is needed");
        showKeyForm(true, key ? "The Edge refused the saved key: enter another one." : "This Edge needs a caller key to show its status.");
        return;  // polling resumes once a key is entered
      }
      if (!response.ok) throw new Error("the Edge answered " + response.status);
      draw(await response.json());
      live("live", "Live · updated " + new Date().toLocaleTimeString());
    } catch (error) {
      live("error", "Edge unreachable, retrying (" + error.message + ")");
    }
    schedule();
  }

  function schedule(delay) {
    if (timer !== null) clearTimeout(timer);
    timer = document.hidden ? null : setTimeout(poll, delay ?? POLL_MS);
  }

  document.addEventListener("visibilitychange", () => { if (!document.hidden) schedule(0); });
  $("key-button").addEventListener("click", () => showKeyForm($("key-form").hidden));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, $("key-input").value.trim());
    $("key-input").value = "";
    showKeyForm(false);
    schedule(0);
  });
  $("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORAGE);
    showKeyForm(false);
    schedule(0);
  });
  schedule(0);
})();
