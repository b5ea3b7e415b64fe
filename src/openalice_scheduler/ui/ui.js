// The dashboard (docs/operations/dashboard.md#dashboard-ui). Plain script, no build step: it asks
// for the secret once, keeps it in sessionStorage (this tab only; never a URL, a cookie or
// localStorage) and reads the gated JSON endpoints with it every few seconds.
//
// Every value from the service is put into the page as text (textContent, text
// nodes), never as markup: owner ids and other strings are the callers' own.
"use strict";

const SECRET_KEY = "openalice-scheduler.secret";
const REFRESH_MS = 3000;
const RECENT_RELEASES = 20;
// As deploy/alerts.yml's SchedulerGuardSilent: a guard silent this long is flagged.
const GUARD_SILENT_S = 300;

let secret = null;
let timer = null;
let live = [];
// The waiting line as last read, and when (this browser's clock).
let line = [];
let lineReadAt = 0;
// Server clock minus this browser's (from the Date header), so that a skewed laptop
// still counts a lease's time left by the scheduler's clock.
let skewMs = 0;
// Bumped at each sign-in and sign-out: a refresh still in flight from before then
// neither stores its secret nor shows its answers.
let generation = 0;

class Refused extends Error {}

// --- start-up and the secret --------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  byId("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const given = byId("secret").value;
    byId("secret").value = "";
    signIn(given);
  });
  byId("forget").addEventListener("click", () => {
    sessionStorage.removeItem(SECRET_KEY);
    showLogin("");
  });
  setInterval(tick, 1000);
  const kept = sessionStorage.getItem(SECRET_KEY);
  if (kept) {
    signIn(kept);
  } else {
    showLogin("");
  }
});

async function signIn(given) {
  generation += 1;
  secret = given;
  byId("login-error").hidden = true;
  setStatus("Checking the secret…");
  if (await refresh()) {
    byId("login").hidden = true;
    byId("dashboard").hidden = false;
    byId("forget").hidden = false;
    schedule();
  }
}

function showLogin(message) {
  generation += 1;
  clearTimeout(timer);
  secret = null;
  byId("dashboard").hidden = true;
  byId("forget").hidden = true;
  byId("login").hidden = false;
  const error = byId("login-error");
  error.textContent = message;
  error.hidden = !message;
  setStatus("");
  byId("secret").focus();
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(async () => {
    if (await refresh()) schedule();
  }, REFRESH_MS);
}

// --- one refresh --------------------------------------------------------------------

// True when the page is up to date or will retry; false when the secret was refused
// or the operator signed out meanwhile.
async function refresh() {
  const mine = generation;
  try {
    const releasedQuery = "state=released&state=failed&order=newest&limit=" +
      (RECENT_RELEASES * 2);
    const [providers, leases, released, waiting, pools] = await Promise.all([
      api("v1/providers"), api("v1/leases"), api("v1/leases?" + releasedQuery),
      api("v1/line"), api("v1/pools"),
    ]);
    if (mine !== generation) return false;
    live = leases;
    renderCapacity(providers);
    renderLive();
    renderReleased(released);
    renderWaiting(waiting);
    renderPools(pools);
    renderHealth(providers);
    await refreshSpend();
    if (mine !== generation) return false;
    // Kept only once the scheduler took it: a wrong secret is never stored.
    sessionStorage.setItem(SECRET_KEY, secret);
    setStatus("Updated " + new Date().toLocaleTimeString() + " · every " +
      REFRESH_MS / 1000 + " s");
    return true;
  } catch (error) {
    if (mine !== generation) return false;
    if (error instanceof Refused) {
      sessionStorage.removeItem(SECRET_KEY);
      showLogin("The scheduler refused this secret (401 unauthorized): it is not the " +
        "INTERNAL_SECRET the scheduler runs with. Enter it again.");
      return false;
    }
    // Not the secret (the scheduler down, its store unavailable): shown, and retried.
    setStatus("Cannot read the scheduler: " + error.message + " (retrying)", true);
    return true;
  }
}

// A gated JSON endpoint, relative to the page (so a path prefix in front is kept).
async function api(path) {
  const response = await timed(path, { headers: { "X-Internal-Secret": secret } });
  if (response.status === 401) throw new Refused();
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const reason = body && body.message ? body.message : "HTTP " + response.status;
    const error = new Error(path.split("?")[0] + ": " + reason);
    error.status = response.status;
    error.code = body && body.error;
    throw error;
  }
  return body;
}

async function timed(path, options) {
  const sent = Date.now();
  const response = await fetch(path, { cache: "no-store", ...options });
  const date = Date.parse(response.headers.get("Date") || "");
  if (!Number.isNaN(date)) {
    // The header has whole seconds: take the middle of that second.
    skewMs = date + 500 - (sent + Date.now()) / 2;
  }
  return response;
}

// --- capacity and use ---------------------------------------------------------------

function renderCapacity(providers) {
  const box = byId("capacity");
  const parts = [];
  for (const p of providers) {
    const head = el("h3", {}, p.name);
    head.append(badge(p.healthy ? "healthy" : "unhealthy", p.healthy ? "" : "bad"));
    parts.push(head);
    if (!p.healthy && p.detail) parts.push(el("p", { class: "note" }, p.detail));
    const kinds = Object.keys(p.kinds || {});
    const rows = [];
    if (kinds.length === 0) {
      for (const [gpu, use] of Object.entries(p.gpu || {})) {
        rows.push(useRow("any · " + gpu, use.in_use, use.capacity, false, 0));
      }
    }
    for (const kind of kinds) {
      for (const [gpu, use] of Object.entries(p.kinds[kind])) {
        // A null per-kind capacity: the kinds share the GPU class's.
        const shared = use.capacity === null && p.gpu && p.gpu[gpu] ?
          p.gpu[gpu].capacity : null;
        const idle = ((p.idle || {})[kind] || {})[gpu] || 0;
        rows.push(useRow(kind + " · " + gpu, use.in_use,
          use.capacity !== null ? use.capacity : shared, shared !== null, idle));
      }
    }
    if (rows.length === 0) rows.push(el("p", { class: "note" }, "No capacity reported."));
    parts.push(...rows);
  }
  box.replaceChildren(...parts);
}

function useRow(label, inUse, capacity, shared, idle) {
  const bar = el("div", { class: "bar" }, el("span"));
  let figure;
  if (capacity === null || capacity === undefined) {
    bar.classList.add("uncapped");
    figure = inUse + " in use · no fixed cap";
  } else {
    const share = capacity > 0 ? Math.min(1, inUse / capacity) : 1;
    bar.firstChild.style.width = (share * 100).toFixed(1) + "%";
    if (inUse >= capacity) bar.classList.add("full");
    figure = inUse + " / " + capacity + (shared ? " (shared by kinds)" : "");
  }
  if (idle) figure += " · " + idle + " idle warm";
  const row = el("div", { class: "row" }, el("span", {}, label), bar,
    el("span", { class: "figure" }, figure));
  row.dataset.use = label;
  return row;
}

// --- the warm pools (GET /v1/pools: each pool's target, workers, cost, hits) ----------

function renderPools(pools) {
  const box = byId("pools");
  if (pools.length === 0) {
    box.replaceChildren(el("p", { class: "note" }, "No warm pool (WARM_POOL is unset)."));
    return;
  }
  const dollars = (v) => (v === null ? "—" : "$" + v.toFixed(2) + "/h");
  const table = el("table", { id: "pool-table" },
    el("thead", {}, el("tr", {}, ...["Pool", "Classes", "Bounds", "Target", "Idle",
      "Warming", "Cost", "Hits (1 h)", "Misses (1 h)"].map((name) => el("th", {}, name)))),
    el("tbody", {}, ...pools.map((p) => {
      const bounds = p.min === p.max ? "fixed " + p.min
        : p.min + "–" + p.max + " +" + p.buffer;
      const row = el("tr", {},
        el("td", {}, p.kind + " · " + p.gpu),
        el("td", {}, p.classes === null ? "any" : p.classes.join(", ")),
        el("td", {}, bounds),
        el("td", { class: "figure" }, String(p.target)),
        el("td", { class: "figure" }, String(p.idle)),
        el("td", { class: "figure" }, String(p.warming)),
        el("td", { class: "money" }, dollars(p.cost_per_hour)),
        el("td", { class: "figure" }, String(p.hits_last_hour)),
        el("td", { class: "figure" }, String(p.misses_last_hour)));
      row.dataset.pool = p.kind + "/" + p.gpu;
      return row;
    })));
  box.replaceChildren(el("div", { class: "scroll" }, table));
}

// --- the waiting line (GET /v1/line: the whole line across replicas) -----------------

// Each waiter's time in line counts on from when the line was read.
function renderWaiting(waiting) {
  line = waiting;
  lineReadAt = Date.now();
  const box = byId("waiting");
  if (waiting.length === 0) {
    box.replaceChildren(el("p", { class: "note" }, "Nobody is waiting."));
    return;
  }
  const callers = (n) => n + (n === 1 ? " caller" : " callers");
  // How many per kind × GPU class, and per priority class, in the line's order.
  const counts = (key) => {
    const found = new Map();
    for (const w of waiting) found.set(key(w), (found.get(key(w)) || 0) + 1);
    return found;
  };
  const rows = [];
  for (const [shape, n] of counts((w) => w.kind + " · " + w.gpu)) {
    const row = el("div", { class: "row" }, el("span", {}, shape), el("span"),
      el("span", { class: "figure" }, callers(n)));
    row.dataset.waiting = shape;
    rows.push(row);
  }
  for (const [name, n] of counts((w) => w.priority_class)) {
    const row = el("div", { class: "row" }, el("span", {}, "class " + name), el("span"),
      el("span", { class: "figure" }, callers(n)));
    row.dataset.waitingClass = name;
    rows.push(row);
  }
  // Each caller, first served first (never its env: the line does not carry it).
  const table = el("table", { id: "line" },
    el("thead", {}, el("tr", {}, ...["#", "Class", "Owner", "Correlation id", "Kind",
      "Waited", "Replica"].map((name) => el("th", {}, name)))),
    el("tbody", {}, ...waiting.map((w) => {
      const replica = cell("Replica", "replica", w.replica.slice(0, 8));
      replica.title = "replica " + w.replica;
      const row = el("tr", {},
        cell("Position", "position", String(w.position)),
        cell("Class", "class", w.priority_class),
        cell("Owner", "owner", w.owner_id === null ? "—" : w.owner_id),
        cell("Correlation id", "correlation",
          w.correlation_id === null ? "—" : w.correlation_id),
        cell("Kind", "", w.kind + " · " + w.gpu + (w.region ? " · " + w.region : "")),
        cell("Waited", "time", duration(w.waited_seconds)),
        replica);
      row.dataset.position = w.position;
      return row;
    })));
  box.replaceChildren(...rows, el("div", { class: "scroll" }, table));
}

// --- live leases ----------------------------------------------------------------------

function renderLive() {
  const table = byId("live");
  const priced = live.some((l) => l.price_per_hour !== undefined && l.price_per_hour !== null);
  table.classList.toggle("no-money", !priced);
  const rows = live.map((lease) => {
    const row = el("tr", {},
      cell("Owner", "owner", lease.owner_id === null ? "—" : lease.owner_id),
      cell("Class", "class", lease.priority_class || "default"),
      cell("Kind", "", lease.kind + " · " + lease.gpu),
      cell("Provider", "", lease.provider + (lease.host ? " · " + lease.host : "")),
      cell("Endpoint", "endpoint", lease.endpoint),
      cell("Time left", "time", ""),
      cell("Price", "money price", lease.price_per_hour === undefined ||
        lease.price_per_hour === null ? "" : money(lease.price_per_hour) + "/h"),
      cell("Cost so far", "money cost", ""));
    row.dataset.leaseId = lease.lease_id;
    row.title = "lease " + lease.lease_id;
    if (lease.state === "preempting") {
      row.classList.add("preempting");
      row.title += " · preempted: its worker goes at " + lease.preempt_at;
    }
    return row;
  });
  table.tBodies[0].replaceChildren(...rows);
  byId("live-count").textContent = "(" + live.length + ")";
  byId("live-empty").hidden = live.length > 0;
  table.hidden = live.length === 0;
  tick();
}

// Every second: time left and cost so far, by the scheduler's clock, and time in line.
function tick() {
  const waitingRows = byId("waiting").querySelectorAll("#line tbody tr");
  const since = Math.max(0, Date.now() - lineReadAt) / 1000;
  for (let i = 0; i < waitingRows.length && i < line.length; i++) {
    waitingRows[i].querySelector(".time").textContent = duration(line[i].waited_seconds + since);
  }
  const now = Date.now() + skewMs;
  const rows = byId("live").tBodies[0].rows;
  for (let i = 0; i < rows.length && i < live.length; i++) {
    const lease = live[i];
    const left = Math.max(0, Date.parse(lease.expires_at) - now) / 1000;
    if (lease.state === "preempting" && lease.preempt_at) {
      // Displaced by a caller of a higher class: its worker goes at preempt_at.
      const grace = Math.max(0, Date.parse(lease.preempt_at) - now) / 1000;
      rows[i].querySelector(".time").textContent = "preempted · goes in " +
        duration(Math.min(grace, left));
    } else {
      rows[i].querySelector(".time").textContent = duration(left);
    }
    if (lease.price_per_hour !== undefined && lease.price_per_hour !== null) {
      // A lease costs from when it was granted (its worker ready), not from the request.
      const since = Date.parse(lease.granted_at || lease.created_at);
      const hours = Math.max(0, now - since) / 3600000;
      rows[i].querySelector(".cost").textContent = money(lease.price_per_hour * hours);
    }
  }
}

// --- recent releases ----------------------------------------------------------------

function renderReleased(leases) {
  // Asked newest-created first; shown by when they ended.
  const ended = leases.slice().sort((a, b) =>
    Date.parse(b.released_at || b.created_at) - Date.parse(a.released_at || a.created_at));
  const shown = ended.slice(0, RECENT_RELEASES);
  const table = byId("released");
  table.classList.toggle("no-money", !shown.some((l) => l.cost !== undefined && l.cost !== null));
  table.tBodies[0].replaceChildren(...shown.map((lease) => {
    const end = lease.released_at ? Date.parse(lease.released_at) : null;
    const row = el("tr", {},
      cell("Ended", "time", end ? new Date(end).toLocaleTimeString() : "—"),
      cell("Owner", "owner", lease.owner_id === null ? "—" : lease.owner_id),
      cell("Class", "class", lease.priority_class || "default"),
      cell("Kind", "", lease.kind + " · " + lease.gpu),
      cell("Provider", "", lease.provider),
      cell("Reason", "reason", lease.release_reason || lease.state),
      cell("Held", "time", end ? duration((end - Date.parse(lease.created_at)) / 1000) : "—"),
      cell("Cost", "money", lease.cost === undefined || lease.cost === null ?
        "" : money(lease.cost)));
    row.dataset.leaseId = lease.lease_id;
    row.title = "lease " + lease.lease_id;
    return row;
  }));
  byId("released-empty").hidden = shown.length > 0;
  table.hidden = shown.length === 0;
}

// --- spend per owner (once the scheduler reports usage) ------------------------------

async function refreshSpend() {
  const box = byId("spend");
  const now = new Date();
  const day = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate()));
  const month = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1));
  let today, thisMonth;
  try {
    [today, thisMonth] = await Promise.all([day, month].map((since) =>
      api("v1/usage?group_by=owner&since=" + encodeURIComponent(since.toISOString()))));
  } catch (error) {
    if (error instanceof Refused) throw error;
    box.replaceChildren(el("p", { class: "note" }, "Spend unavailable: " + error.message));
    return;
  }
  const days = usageByOwner(today);
  const months = usageByOwner(thisMonth);
  const owners = [...new Set([...months.keys(), ...days.keys()])].sort();
  if (owners.length === 0 || ![...months.values()].some((cost) => cost > 0)) {
    box.replaceChildren(el("p", { class: "note" }, "No prices configured, or nothing " +
      "spent this month."));
    return;
  }
  const table = el("table", {},
    el("thead", {}, el("tr", {}, el("th", {}, "Owner"), el("th", {}, "Today (UTC)"),
      el("th", {}, "This month"))),
    el("tbody", {}, ...owners.map((owner) => el("tr", {}, cell("Owner", "owner", owner),
      cell("Today (UTC)", "", money(days.get(owner) || 0)),
      cell("This month", "", money(months.get(owner) || 0))))));
  box.replaceChildren(table);
}

// Owner → cost from a `GET /v1/usage?group_by=owner` answer: {groups: [{key, cost, …}]},
// `key` null for leases without an owner (docs/concepts/money.md#usage-and-retention).
function usageByOwner(answer) {
  const costs = new Map();
  for (const group of (answer && answer.groups) || []) {
    costs.set(group.key === null ? "—" : String(group.key), Number(group.cost) || 0);
  }
  return costs;
}

// --- guards and fleet hosts -----------------------------------------------------------

function renderHealth(providers) {
  const parts = [];
  for (const p of providers) {
    const guards = p.guards || [];
    const hosts = p.hosts || [];
    if (guards.length === 0 && hosts.length === 0) continue;
    parts.push(el("h3", {}, p.name));
    if (hosts.length) {
      parts.push(el("ul", { class: "plain" }, ...hosts.map((h) => {
        const item = el("li", {}, h.name);
        item.dataset.host = h.name;
        item.append(badge(h.healthy ? "healthy" : "unhealthy", h.healthy ? "" : "bad"));
        const facts = [];
        if (h.region) facts.push("region " + h.region);
        if (h.workers !== null) {
          facts.push(h.workers + (h.max_workers ? " / " + h.max_workers : "") + " workers");
        }
        if ((h.gpu_devices || []).length) facts.push("GPUs " + h.gpu_devices.join(", "));
        if (!h.healthy && h.detail) facts.push(h.detail);
        if (facts.length) item.append(" " + facts.join(" · "));
        return item;
      })));
    }
    if (guards.length) {
      parts.push(el("ul", { class: "plain" }, ...guards.map((g) => {
        const silent = g.silent_seconds > GUARD_SILENT_S;
        const item = el("li", {}, "guard " + g.guard_id);
        item.dataset.guard = g.guard_id;
        item.append(badge(silent ? "silent" : "polling", silent ? "warn" : ""),
          " last contact " + duration(g.silent_seconds) + " ago");
        return item;
      })));
    }
  }
  if (parts.length === 0) {
    parts.push(el("p", { class: "note" }, "No guards have polled and no fleet hosts " +
      "(DOCKER_HOSTS) are configured."));
  }
  byId("health").replaceChildren(...parts);
}

// --- small helpers ----------------------------------------------------------------------

function byId(id) {
  return document.getElementById(id);
}

// An element whose children are elements or strings, strings always as text.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

// A table cell; `label` heads it where a phone shows each row as a card (ui.css).
function cell(label, classes, text) {
  const attrs = { "data-label": label };
  if (classes) attrs.class = classes;
  return el("td", attrs, text);
}

function badge(text, tone) {
  return el("span", { class: "badge" + (tone ? " " + tone : "") }, text);
}

function setStatus(text, isError = false) {
  const status = byId("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

// 3725 s → "1h 02m 05s"; 65 s → "1m 05s"; 5 s → "5s".
function duration(seconds) {
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const rest = String(s % 60).padStart(2, "0");
  if (h > 0) return h + "h " + String(m).padStart(2, "0") + "m " + rest + "s";
  if (m > 0) return m + "m " + rest + "s";
  return (s % 60) + "s";
}

function money(dollars) {
  return "$" + Number(dollars).toFixed(dollars < 1 ? 4 : 2);
}
