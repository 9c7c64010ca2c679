"""The search page ``hpcfed search serve`` shows at ``/``: one static HTML document, a little JavaScript.

A person types a query (a document's id, or text where the home site has a text model), picks filters
(site, label or label name, a time range, any ``KEY=VALUE`` attribute), and sees the answers grouped
by site with their label names, scores, times and texts, and a link to the JSON the page got from
``POST /search``. Nothing is fetched from the network but the service itself, and no build step
makes the page. Everything that came from a query or a document is put on the page as text
(``textContent``), never as markup, so a query holding ``<script>`` shows as those characters.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'self'; script-src 'unsafe-inline';
 style-src 'unsafe-inline'; connect-src 'self'; img-src 'none'; object-src 'none'">
<title>hpcfed search</title>
<style>
 body { font: 15px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 60em; padding: 0 1em; color: #222; }
 form { display: grid; grid-template-columns: 9em 1fr; gap: .4em .8em; align-items: center; }
 input, select { font: inherit; padding: .25em; }
 #query { width: 100%; box-sizing: border-box; }
 .site { border-top: 2px solid #446; margin-top: 1.2em; }
 .hit { margin: .5em 0; } .score { color: #555; font-variant-numeric: tabular-nums; }
 .label { background: #eef; padding: 0 .3em; border-radius: 3px; } .doc { white-space: pre-wrap; color: #333; }
 #status { margin: 1em 0; } #status.error { color: #a00; } #echo { overflow-wrap: anywhere; max-height: 6em;
 overflow: auto; }
</style></head>
<body>
<h1>hpcfed search</h1>
<p id="sites"></p>
<form id="form">
 <label for="query">query</label><input id="query" name="query" autocomplete="off"
   placeholder="a document's id, or text">
 <label for="kind">by</label><select id="kind"><option value="id">id</option><option value="text">text</option></select>
 <label for="home">home site</label><select id="home"></select>
 <label for="k">results</label><input id="k" type="number" min="1" max="100" value="10">
 <label for="f-site">only site</label><select id="f-site"><option value="">any</option></select>
 <label for="f-label">label</label><input id="f-label" placeholder="a label or its name (comma: either)">
 <label for="f-from">time from</label><input id="f-from" placeholder="2012-10-29 or 2012-10-29T10:00">
 <label for="f-to">time to</label><input id="f-to" placeholder="(excluded)">
 <label for="f-other">other</label><input id="f-other" placeholder="KEY=VALUE, KEY=VALUE">
 <label for="token">token</label><input id="token" type="password" placeholder="only if the service asks one">
 <span></span><button id="go" type="submit">Search</button>
</form>
<div id="status"></div>
<p>query: <span id="echo"></span> <a id="json" hidden download="results.json">JSON</a></p>
<div id="results"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = String(text);  // text, never markup
  return node;
}
function status(text, error) { $("status").textContent = text; $("status").className = error ? "error" : ""; }
function headers() {
  const token = $("token").value.trim();
  return token ? { Authorization: `Bearer ${token}` } : {};
}
async function health() {
  const reply = await fetch("/health", { headers: headers() });
  if (!reply.ok) { status("enter the service's token, then search", true); return; }
  const info = await reply.json();
  $("sites").textContent = info.sites.map((s) => `site ${s.site}: ${s.count} documents (${s.index})`).join("; ");
  for (const s of info.sites) {
    $("home").append(new Option(s.site, s.site));
    $("f-site").append(new Option(s.site, s.site));
  }
}
function where() {
  const out = {};
  if ($("f-site").value) out.site = $("f-site").value;
  const labels = $("f-label").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (labels.length) out.label = labels;
  const from = $("f-from").value.trim(), to = $("f-to").value.trim();
  if (from || to) out.time = `${from}..${to}`;
  for (const pair of $("f-other").value.split(",").map((s) => s.trim()).filter(Boolean)) {
    const at = pair.indexOf("=");
    const key = at < 0 ? pair : pair.slice(0, at).trim();
    (out[key] = out[key] || []).push(at < 0 ? "" : pair.slice(at + 1).trim());
  }
  return out;
}
function show(answer) {
  const box = $("results");
  box.replaceChildren();
  const bySite = new Map();
  for (const hit of answer.results) {
    if (!bySite.has(hit.site)) bySite.set(hit.site, []);
    bySite.get(hit.site).push(hit);
  }
  if (!answer.results.length) box.append(el("p", "", "no documents match"));
  for (const [site, hits] of bySite) {
    const part = el("section", "site");
    part.dataset.site = site;
    part.append(el("h2", "", `site ${site} (${hits.length})`));
    for (const hit of hits) {
      const row = el("div", "hit");
      row.append(el("span", "score", hit.score.toFixed(3)), " ", el("b", "id", hit.id), " ");
      row.append(el("span", "label", hit.label_name !== undefined ? hit.label_name : `label ${hit.label}`));
      if (hit.time) row.append(" ", el("span", "time", hit.time));
      if (hit.text) row.append(el("div", "doc", hit.text));
      part.append(row);
    }
    box.append(part);
  }
}
async function search(event) {
  event.preventDefault();
  const text = $("query").value;
  $("echo").textContent = text;
  $("json").hidden = true;
  const query = $("kind").value === "id" ? { id: text.trim() } : { text: text, home: $("home").value };
  const body = { ...query, k: Number($("k").value) || 10 };
  const filters = where();
  if (Object.keys(filters).length) body.where = filters;
  status("searching ...");
  try {
    if (!$("home").options.length) await health();
    const reply = await fetch("/search", { method: "POST", body: JSON.stringify(body),
                                            headers: { "Content-Type": "application/json", ...headers() } });
    const data = await reply.json();
    if (!reply.ok) { $("results").replaceChildren(); status(data.error || `error ${reply.status}`, true); return; }
    show(data.queries[0]);
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    $("json").href = URL.createObjectURL(blob);
    $("json").hidden = false;
    status(`${data.queries[0].results.length} results`);
  } catch (err) {
    status(`the service did not answer (${err})`, true);
  }
}
$("form").addEventListener("submit", search);
health().catch((err) => status(`the service did not answer (${err})`, true));
</script>
</body></html>
"""


def page_bytes() -> bytes:
    """The page as served (UTF-8)."""
    return PAGE.encode("utf-8")
