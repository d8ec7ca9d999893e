"""HTML of every page, rendered on the server from views.py's dicts: f-strings and
html.escape, no template engine. Each page function returns (title, main HTML); app.py
wraps it in layout() (or sends the main part alone to admin.js's refresh).

Every form POSTs with the CSRF token; destructive ones carry `data-confirm`, which
admin.js turns into a confirm() before sending.
"""

from __future__ import annotations

import html
import json
import time
from urllib.parse import quote

from .history import sparkline
from .times import iso

esc = html.escape
LOAD_FIELDS = ("node_load_factor", "leader_load_factor", "cpu", "msgs_per_s", "backlog")
MAX_ROWS = 200  # rows of a node page's table; the rest are in /api/nodes/<node>
PREVIEW_CHARS = 60  # of a dead letter's body in its row


def u(name: str) -> str:
    """A name as one URL path segment (`#ephemeral` and dots included)."""
    return quote(name, safe="")


def num(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else esc(str(v))


def count(n: int, noun: str) -> str:
    """`1 message`, `0 messages`, `1,234 messages`: a number and its noun, singular for 1."""
    return f"{num(n)} {esc(noun) if n == 1 else esc(noun) + 's'}"


def yes(v) -> str:
    return "yes" if v else "no" if v is not None else "?"


def table(headers: list[str], rows: list[list[str]], cls: str = "", empty: str = "none") -> str:
    """Cells are HTML already; an empty table says `empty`."""
    if not rows:
        return f'<p class="empty">{esc(empty)}</p>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td data-label="{esc(h)}"><span>{c}</span></td>'
                                    for h, c in zip(headers, r)) + "</tr>" for r in rows)
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{head}</tr></thead>' \
           f'<tbody>{body}</tbody></table></div>'


def capped(rows: list, api: str) -> tuple[list, str]:
    """The first MAX_ROWS rows, and a line saying where the others are."""
    if len(rows) <= MAX_ROWS:
        return rows, ""
    return rows[:MAX_ROWS], (f'<p class="note">first {MAX_ROWS} of {len(rows):,}: all in '
                             f'<a href="{esc(api)}">{esc(api)}</a></p>')


def form(action: str, label: str, ctx: dict, confirm: str = "", fields: str = "",
         cls: str = "") -> str:
    data = f' data-confirm="{esc(confirm)}"' if confirm else ""
    return (f'<form method="post" action="{esc(action)}" class="action {cls}"{data}>'
            f'<input type="hidden" name="csrf" value="{esc(ctx["csrf"])}">{fields}'
            f'<button type="submit">{esc(label)}</button></form>')


def node_link(http: str, label: str = "") -> str:
    return f'<a href="/nodes/{u(http)}">{esc(label or http)}</a>' if http else "<i>none</i>"


def layout(title: str, main: str, ctx: dict) -> str:
    user = ctx.get("user")
    if ctx.get("auth"):
        who = (f'<span class="user">{esc(user)}</span>'
               f'{form("/logout", "log out", ctx, cls="inline")}' if user
               else '<a class="login" href="/login">log in</a>')
    else:
        who = ""
    flash = ctx.get("flash") or ""
    flash_html = f'<p class="flash {"bad" if "FAILED" in flash else ""}">{esc(flash)}</p>' \
        if flash else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{esc(title)} · nsqadmin</title>'
            f'<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">'
            f'<link rel="stylesheet" href="/static/admin.css"></head>'
            f'<body data-refresh="{ctx.get("refresh", 0)}"><header><nav>'
            f'<a class="brand" href="/">nsqadmin</a><a href="/">topics</a>'
            f'<a href="/cluster">cluster</a><a href="/trace">trace</a>{who}</nav></header>'
            f'{flash_html}<main id="main">{main}</main>'
            f'<script src="/static/admin.js"></script></body></html>')


def _age(v: dict) -> str:
    age = v.get("age_s", -1)
    if age < 0:
        return '<p class="age">not read yet</p>'
    return f'<p class="age">read {age:g} s ago · mode <b>{esc(v["mode"])}</b></p>'


# ---- pages --------------------------------------------------------------------------

def cluster_page(v: dict, ctx: dict) -> tuple[str, str]:
    out = [f"<h1>Cluster</h1>{_age(v)}"]
    if v["etcd"] is not None:
        e = v["etcd"]
        out.append(f'<p>etcd: <b class="{"ok" if e["healthy"] else "bad"}">'
                   f'{"healthy" if e["healthy"] else "trouble"}</b> '
                   f'({e["connected"]} of {e["asked"]} daemons connected)</p>')
    if v["lookupds"]:
        rows = [[esc(lk["address"]), yes(lk["is_master"]) if lk["is_master"] is not None
                 else "classic", esc(lk["master"] or ""), yes(lk["etcd_connected"]),
                 esc(lk["view"] or ""), esc(", ".join(lk["leaderless"]) or "none"),
                 esc(lk["error"] or "ok")] for lk in v["lookupds"]]
        out.append("<h2>nsqlookupd</h2>" + table(
            ["address", "master", "master address", "etcd", "view", "leaderless", "state"],
            rows))
    else:
        out.append('<p class="note">no nsqlookupd: nsqadmin reads the nsqd given by '
                   '--nsqd-http-address</p>')
    rows = []
    for n in v["nodes"]:
        load = n["load"] or {}
        shown = [(k, load[k]) for k in LOAD_FIELDS if load.get(k) is not None]
        load_html = "<br>".join(f"{esc(k)} {num(val)}" for k, val in shown) or "—"
        rows.append([node_link(n["http"]), esc(n["node_id"] or n["tcp"]), esc(n["hostname"]),
                     esc(n["version"]), num(n["partitions_led"]), num(n["topics"]),
                     num(n["clients"]), load_html,
                     f'<span class="bad">{esc(n["error"])}</span>' if n["error"]
                     else esc(n["health"] or "?")])
    out.append("<h2>Nodes</h2>" + table(
        ["node", "id / tcp", "host", "version", "partitions led", "topics", "clients",
         "load", "health"], rows, empty="no nsqd found"))
    if not v["load_available"]:
        out.append(f'<p class="note" id="load-note">{esc(v["load_note"])}</p>')
    else:
        heavy = ", ".join(f'<a href="/topics/{u(t.get("topic", ""))}">{esc(t.get("topic", ""))}'
                          f'</a> {num(t.get("load_factor", ""))}' for t in v["heaviest_topics"])
        out.append(f'<p id="balance">balanced: <b>{yes(v["balanced"])}</b>'
                   f'{" · heaviest topics: " + heavy if heavy else ""}</p>'
                   + form("/cluster/balance", "balance now", ctx,
                          confirm="Make one balancer move now (within the balance window)?"))
    if v["problems"]:
        out.append("<h2>Problems</h2><ul class=\"problems\">" +
                   "".join(f"<li>{esc(p)}</li>" for p in v["problems"]) + "</ul>")
    out.append(f'<p class="age">{count(v["topics"], "topic")} · last poll took '
               f'{v["poll_seconds"]:g} s</p>')
    return "Cluster", "".join(out)


def _flags(t: dict) -> str:
    f = [name for name in ("paused", "ordered", "traced") if t.get(name)]
    return " ".join(f'<span class="tag {x}">{x}</span>' for x in f)


def topics_page(v: dict, ctx: dict) -> tuple[str, str]:
    rows = [[f'<a href="/topics/{u(t["name"])}">{esc(t["name"])}</a> {_flags(t)}',
             num(t["partitions"]), num(t["channels"]), num(t["messages"]), num(t["depth"]),
             num(t["rate"]), num(t["nodes"])] for t in v["topics"]]
    create = form("/topics", "create topic", ctx, fields=(
        '<input name="topic" placeholder="topic name" required pattern="[.a-zA-Z0-9_-]+(#ephemeral)?">'
        '<input name="partitions" placeholder="partitions" inputmode="numeric" size="6">'
        + ('<input name="replicas" placeholder="replicas" inputmode="numeric" size="6">'
           if v["mode"] == "cluster" else "")))
    problems = (f'<p class="bad" id="problems"><a href="/cluster">'
                f'{count(len(v["problems"]), "problem")}</a> in the cluster</p>'
                if v["problems"] else "")
    return "Topics", (f"<h1>Topics</h1>{_age(v)}{problems}" + table(
        ["topic", "partitions", "channels", "messages", "depth", "msgs/s", "nodes"], rows,
        cls="topics", empty="no topics") + create)


def _halves_cell(p: dict) -> str:
    """A partition's half messages: waiting, then decided, one number a line (the column
    stays narrow: the table fits 1280 px). The expired ones were rolled back too."""
    return (f'{num(p["half_waiting"])} waiting<br><small>{num(p["half_committed"])} '
            f'committed<br>{num(p["half_rolled_back"])} rolled back<br>'
            f'({num(p["half_expired"])} expired)</small>')


def _halves_line(v: dict, base: str) -> str:
    """The topic's half messages, with the link to those waiting (always shown)."""
    return (f'<p id="halves">half messages: <a href="{base}/half">'
            f'{num(v["half_waiting"])} waiting</a> · {num(v["half_committed"])} committed · '
            f'{num(v["half_rolled_back"])} rolled back ({num(v["half_expired"])} expired)</p>')


def topic_page(v: dict, ctx: dict) -> tuple[str, str]:
    name = v["name"]
    base = f"/topics/{u(name)}"
    charts = (f'<div class="charts"><figure>{sparkline(v["rates"], "messages/s")}'
              f'<figcaption>rate {num(v["rate"])}/s</figcaption></figure><figure>'
              f'{sparkline(v["depths"], "depth")}<figcaption>depth {num(v["depth"])}'
              f'</figcaption></figure></div>')
    acts = "".join([
        form(f"{base}/unpause" if v["paused"] else f"{base}/pause",
             "unpause" if v["paused"] else "pause", ctx),
        form(f"{base}/trace_off" if v["traced"] else f"{base}/trace_on",
             "tracing off" if v["traced"] else "tracing on", ctx),
        form(f"{base}/empty", "empty", ctx, confirm=f"Empty topic {name}? Its messages "
                                                     "are dropped for channels to come."),
        form(f"{base}/delete", "delete", ctx, confirm=f"Delete topic {name} and all its "
                                                      "channels and messages?")])
    prow = []
    for p in v["partitions"]:
        isr = "<br>".join(node_link(h, i) if h else esc(i)
                          for i, h in zip(p["isr"], p["isr_http"])) or "—"
        row = [num(p["number"]), node_link(p["leader"], p["leader_id"] or p["leader"]),
               isr, "<br>".join(esc(i) for i in p["catchup"]) or "—",
               num(p["epoch"]) if p["epoch"] is not None else "—",
               ("—" if p["writable"] is None else yes(p["writable"]))
               + (f'<br><small>{esc(p["reason"])}</small>' if p["reason"] else "")
               + (f'<br><span class="bad">{esc(p["error"])}</span>' if p["error"] else ""),
               num(p["messages"]),
               f'{num(p["depth"])} ' + sparkline([float(d) for d in p["depths"]],
                                                 f"partition {p['number']} depth", 80, 18),
               f'{num(p["rate"])} ' + sparkline(p["rates"],
                                                f"partition {p['number']} messages/s", 80, 18),
               _halves_cell(p)]
        if v["mode"] == "cluster":
            row.append(_move_leader_form(base, p, ctx))
        prow.append(row)
    heads = ["partition", "leader", "ISR", "catch-up", "epoch", "writable", "messages",
             "depth", "msgs/s", "half messages"]
    heads += ["move leader"] if v["mode"] == "cluster" else []
    parts = table(heads, prow, cls="partitions",
                  empty=v["partitions_note"] or "no partitions")
    note = f'<p class="note" id="replication-note">{esc(v["replication_note"])}</p>' \
        if v["replication_note"] else ""
    crow = [[f'<a href="{base}/{u(c["name"])}">{esc(c["name"])}</a> {_flags(c)}',
             num(c["depth"]), num(c["in_flight"]), num(c["deferred"]), num(c["delayed"]),
             num(c["requeued"]), num(c["timed_out"]), num(c["confirmed_count"]),
             num(c["rate"]), num(c["clients"])] for c in v["channels"]]
    chans = table(["channel", "depth", "in flight", "deferred", "delayed", "requeued",
                   "timed out", "confirmed", "confirmed/s", "clients"], crow, cls="channels",
                  empty="no channels")
    add = form(f"{base}/channel_create", "create channel", ctx,
               fields='<input name="channel" placeholder="channel name" required>')
    return f"Topic {name}", (
        f'<h1>Topic <span class="name">{esc(name)}</span> {_flags(v)}</h1>{_age(v)}'
        f'<p>{count(v["partition_num"], "partition")} · {count(v["messages"], "message")} · depth '
        f'{num(v["depth"])}</p>{_halves_line(v, base)}{charts}'
        f'<div class="actions">{acts}</div>'
        f'<h2>Partitions</h2>{note}{parts}<h2>Channels</h2>{chans}{add}')


def channel_page(v: dict, ctx: dict) -> tuple[str, str]:
    topic, name = v["topic"], v["name"]
    base = f"/topics/{u(topic)}/{u(name)}"
    stats = "".join(f'<div class="stat"><b id="stat-{k.replace(" ", "-")}">{num(v[f])}</b>'
                    f'<span>{k}</span></div>' for k, f in (
                        ("depth", "depth"), ("in flight", "in_flight"),
                        ("deferred", "deferred"), ("delayed", "delayed"),
                        ("requeued", "requeued"), ("timed out", "timed_out"),
                        ("confirmed", "confirmed_count"), ("confirmed/s", "rate")))
    stats += (f'<div class="stat"><b id="stat-dead-letters"><a href="{base}/dead">'
              f'{num(v["dead"])}</a></b><span>dead letters</span></div>')
    acts = "".join([
        form(f"{base}/unpause" if v["paused"] else f"{base}/pause",
             "unpause" if v["paused"] else "pause", ctx),
        form(f"{base}/trace_off" if v["traced"] else f"{base}/trace_on",
             "tracing off" if v["traced"] else "tracing on", ctx),
        form(f"{base}/empty", "empty", ctx, confirm=f"Empty channel {name}? Its messages "
                                                     "are dropped."),
        form(f"{base}/delete", "delete", ctx, confirm=f"Delete channel {name}?"),
        form(f"{base}/setoffset", "replay from", ctx,
             confirm=f"Move channel {name} to this time? Messages from there are delivered "
                     "again.", fields='<input name="time" class="when" required '
                                      'placeholder="-1h, 2026-11-26T10:00 or unix s">'),
        form(f"{base}/max_attempts", "set max attempts", ctx,
             fields=f'<input name="max_attempts" type="number" min="0" max="65535" required '
                    f'value="{v["max_attempts"]}" aria-label="max attempts (0: never bury)">')])
    now = time.time()
    crow = [[esc(c.get("hostname", "")) + f' <small>{esc(c.get("remote_address", ""))}</small>',
             esc(c.get("user_agent", "")), node_link(c.get("node", "")),
             num(c.get("ready_count", 0)), num(c.get("in_flight_count", 0)),
             num(c.get("message_count", 0)), num(c.get("finish_count", 0)),
             num(c.get("requeue_count", 0)),
             f'{max(0, int(now - c.get("connect_ts", now)))} s'] for c in v["clients"]]
    clients = table(["client", "user agent", "node", "RDY", "in flight", "messages",
                     "finished", "requeued", "connected"], crow, cls="clients",
                    empty="no clients connected")
    prow = [[num(p["partition"]), node_link(p["node"]), num(p["depth"]), num(p["in_flight"]),
             num(p["deferred"]), num(p["delayed"]), num(p["requeued"]), num(p["timed_out"]),
             yes(p["paused"]), yes(p["ordered"]), num(p["confirmed_count"]),
             num(p["confirmed"]), num(p["next_read"]), num(p["dead"]),
             num(p["max_attempts"]) if p["max_attempts"] else "—"] for p in v["partitions"]]
    parts = table(["partition", "node", "depth", "in flight", "deferred", "delayed",
                   "requeued", "timed out", "paused", "ordered", "confirmed",
                   "confirmed offset", "next read offset", "dead", "max attempts"],
                  prow, cls="channel-partitions")
    return f"Channel {topic}/{name}", (
        f'<h1><a href="/topics/{u(topic)}">{esc(topic)}</a> / <span class="name">'
        f'{esc(name)}</span> {_flags(v)}</h1>{_age(v)}<p>ordered: <b id="ordered">'
        f'{yes(v["ordered"])}</b> · paused: <b id="paused">{yes(v["paused"])}</b></p>'
        f'<div class="stats">{stats}</div>'
        f'<div class="charts"><figure>{sparkline(v["rates"], "confirmed/s")}'
        f'<figcaption>confirmed/s</figcaption></figure><figure>'
        f'{sparkline([float(d) for d in v["depths"]], "depth")}'
        f'<figcaption>depth</figcaption></figure></div><div class="actions">{acts}</div>'
        f'<h2>Clients</h2>{clients}<h2>Partitions</h2>{parts}')


def _dead_title(v: dict, what: str) -> str:
    topic, channel = v["topic"], v["channel"]
    return (f'<h1><a href="/topics/{u(topic)}">{esc(topic)}</a> / <a href="/topics/{u(topic)}'
            f'/{u(channel)}">{esc(channel)}</a> / <span class="name">{esc(what)}</span></h1>')


def _dead_buttons(base: str, letter_id: str, ctx: dict) -> str:
    """Requeue and purge of one dead letter."""
    field = f'<input type="hidden" name="id" value="{esc(letter_id)}">'
    return (form(f"{base}/dead_requeue", "requeue", ctx, fields=field, cls="inline")
            + form(f"{base}/dead_purge", "purge", ctx, fields=field, cls="inline",
                   confirm=f"Purge dead letter {letter_id}? It is gone for good."))


def _preview(d: dict) -> str:
    """The start of a dead letter's body, for a table cell."""
    if d.get("body") is None:
        return f'<small>binary, {count(d["body_size"], "byte")}</small>'
    text = d["body"][:PREVIEW_CHARS]
    more = "…" if d["body_size"] > len(text.encode()) else ""
    return f'<code>{esc(text)}</code>{more}'


def _iso_ns(ns) -> str:
    return esc(iso(ns / 1e9)) if isinstance(ns, int) else "—"


def dead_page(v: dict, ctx: dict) -> tuple[str, str]:
    """A channel's dead letters: a page of them, each with its buttons, and the next page."""
    topic, channel = v["topic"], v["channel"]
    base = f"/topics/{u(topic)}/{u(channel)}"
    limit = num(v["max_attempts"]) if v["max_attempts"] else "none (never bury)"
    out = [_dead_title(v, "dead letters"),
           f'<p id="dead-count">{count(v["count"], "dead letter")} · max attempts '
           f'<b>{limit}</b></p>']
    if v["loading"]:
        out.append(f'<p class="note">still read back from the log on partitions '
                   f'{esc(", ".join(str(p) for p in v["loading"]))}: ask again soon</p>')
    for e in v["errors"]:
        out.append(f'<p class="bad">{esc(e["node"])}: {esc(str(e["status"] or "no answer"))} '
                   f'{esc(e["message"])}</p>')
    if v["count"]:
        out.append('<div class="actions">' + form(
            f"{base}/dead_requeue", "requeue all", ctx,
            confirm=f"Requeue every dead letter of {channel}? Each is delivered again.")
            + form(f"{base}/dead_purge", "purge all", ctx,
                   confirm=f"Purge every dead letter of {channel}? They are gone for good.")
            + "</div>")
    rows = [[f'<a href="{base}/dead/{u(d["id"])}">{esc(d["id"])}</a>', num(d["partition"]),
             esc(d["message_id"] or ""), num(d["attempts"]), esc(d["cause"] or ""),
             esc(d["error"] or ""), _iso_ns(d["buried_ns"]), _preview(d),
             _dead_buttons(base, d["id"], ctx)] for d in v["dead_letters"]]
    out.append(table(["id", "partition", "message id", "attempts", "cause", "error", "buried",
                      "body", ""], rows, cls="dead-letters", empty="no dead letters"))
    if v["next"]:
        out.append(f'<p><a id="next-page" href="{base}/dead?after={u(v["next"])}'
                   f'&amp;limit={v["limit"]}">next page</a></p>')
    return f"Dead letters {topic}/{channel}", "".join(out)


def dead_letter_page(v: dict, ctx: dict) -> tuple[str, str]:
    """One dead letter: every field, its header and its whole body."""
    base = f"/topics/{u(v['topic'])}/{u(v['channel'])}"
    facts = [("id", esc(v["id"])), ("partition", num(v["partition"])),
             ("node", node_link(v["node"])), ("message id", esc(v["message_id"] or "—")),
             ("attempts", num(v["attempts"])), ("cause", esc(v["cause"] or "—")),
             ("error", esc(v["error"] or "—")), ("published", _iso_ns(v["published_ns"])),
             ("buried", _iso_ns(v["buried_ns"])), ("body size", count(v["body_size"], "byte"))]
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{val}</dd>" for k, val in facts)
    ext = (f'<pre class="ext">{esc(json.dumps(v["ext"], indent=2, ensure_ascii=False))}</pre>'
           if v.get("ext") is not None else '<p class="note">no header</p>')
    if v.get("body") is not None:
        body = f'<pre class="body text">{esc(v["body"])}</pre>'
    else:
        body = (f'<pre class="body base64">{esc(v["body_base64"])}</pre>'
                '<small>not UTF-8: base64</small>')
    return f"Dead letter {v['id']}", (
        _dead_title(v, f"dead letter {v['id']}")
        + f'<p><a href="{base}/dead">all dead letters</a></p><dl>{dl}</dl>'
        + f'<div class="actions">{_dead_buttons(base, v["id"], ctx)}</div>'
        + f"<h2>Header</h2>{ext}<h2>Body</h2>{body}")


def _half_buttons(base: str, half_id: str, ctx: dict) -> str:
    """Commit and rollback of one half message."""
    field = f'<input type="hidden" name="id" value="{esc(half_id)}">'
    return (form(f"{base}/half_commit", "commit", ctx, fields=field, cls="inline")
            + form(f"{base}/half_rollback", "rollback", ctx, fields=field, cls="inline",
                   confirm=f"Roll back half message {half_id}? It is never delivered."))


def half_page(v: dict, ctx: dict) -> tuple[str, str]:
    """A topic's half messages waiting for their decision, each with its buttons, and each
    partition's counts."""
    topic = v["topic"]
    base = f"/topics/{u(topic)}"
    out = [f'<h1><a href="{base}">{esc(topic)}</a> / <span class="name">half messages'
           f'</span></h1><p id="half-count">{count(v["count"], "half message")} waiting</p>']
    for e in v["errors"]:
        out.append(f'<p class="bad">{esc(e["node"])}: {esc(str(e["status"] or "no answer"))} '
                   f'{esc(e["message"])}</p>')
    shown, more = capped(v["waiting"], f"/api{base}/half")
    rows = [[num(w["partition"]), node_link(w["node"]), f'<code>{esc(w["id"])}</code>',
             esc(iso(w["written_ms"] / 1000)), num(w["checks"]),
             f'<code>{esc(w["check_url"])}</code>', _half_buttons(base, w["id"], ctx)]
            for w in shown]
    out.append(table(["partition", "leader", "id", "written", "check-backs", "check URL", ""],
                     rows, cls="half-waiting", empty="no half message waiting") + more)
    prow = [[num(p["partition"]), node_link(p["node"]), num(p["waiting"]),
             num(p["committed"]), num(p["rolled_back"]), num(p["expired"]), num(p["checks"])]
            for p in v["partitions"]]
    out.append("<h2>Partitions</h2>" + table(
        ["partition", "leader", "waiting", "committed", "rolled back", "expired",
         "check-backs"], prow, cls="half-partitions", empty="no partition answered"))
    return f"Half messages {topic}", "".join(out)


def _move_leader_form(base: str, p: dict, ctx: dict) -> str:
    """A choice of the partition's other in-sync replicas, to lead it instead."""
    others = [i for i in p["isr"] if i != p["leader_id"]]
    if not others:
        return "—"
    options = "".join(f'<option value="{esc(i)}">{esc(i)}</option>' for i in others)
    return form(f"{base}/move_leader", "move", ctx, cls="inline",
                confirm=f"Move the leader of partition {p['number']}? Its publishers retry "
                        "for a moment.",
                fields=f'<input type="hidden" name="partition" value="{p["number"]}">'
                       f'<select name="to" aria-label="new leader">{options}</select>')


def _drain_html(v: dict, ctx: dict) -> str:
    """Cluster mode: the node's drain state (from the master's load report) and its
    buttons."""
    load = v.get("load") or {}
    state = "removable" if load.get("removable") else "draining" if load.get("draining") \
        else "serving"
    base = f"/nodes/{u(v['http'])}"
    button = form(f"{base}/drain_cancel", "cancel drain", ctx) if state == "draining" else \
        form(f"{base}/drain", "drain", ctx, confirm=f"Drain {v['http']}? Every partition it "
             "leads or follows moves to other nodes, one at a time.")
    return (f'<h2>Drain</h2><p id="drain-state">state: <b>{esc(state)}</b></p>'
            f'<div class="actions">{button}</div>')


def node_page(v: dict, ctx: dict) -> tuple[str, str]:
    http = v["http"]
    facts = [("HTTP", http), ("TCP", v["tcp"]), ("node id", v["node_id"] or "—"),
             ("host", v["hostname"]), ("version", v["version"]),
             ("health", v["error"] or v["health"]), ("clients", v["clients"]),
             ("partitions led", v["partitions_led"]),
             ("etcd", yes(v["etcd_connected"]) if v["etcd_connected"] is not None else "—"),
             ("trace sink", (v["trace"] or {}).get("sink", "—"))]
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{num(val)}</dd>" for k, val in facts)
    api = f"/api/nodes/{u(http)}"
    rows, more_led = capped(v["led"], api)
    led = table(["topic", "partition", "ISR", "epoch", "messages", "depth"], [
        [f'<a href="/topics/{u(p["topic"])}">{esc(p["topic"])}</a>', num(p["number"]),
         esc(", ".join(p["isr"]) or "—"), num(p["epoch"]) if p["epoch"] is not None else "—",
         num(p["messages"]), num(p["depth"])] for p in rows], empty="leads nothing") + more_led
    rows, more_f = capped(v["following"], api)
    following = table(["topic", "partition"], [
        [f'<a href="/topics/{u(f["topic"])}">{esc(f["topic"])}</a>', num(f["partition"])]
        for f in rows], empty="follows nothing") + more_f
    rows, more_c = capped(v["client_list"], api)
    clients = table(["topic", "channel", "client", "user agent", "RDY", "in flight"], [
        [esc(c["topic"]), f'<a href="/topics/{u(c["topic"])}/{u(c["channel"])}">'
         f'{esc(c["channel"])}</a>', esc(f'{c["hostname"]} {c["remote_address"]}'),
         esc(c["user_agent"] or ""), num(c["ready_count"]), num(c["in_flight_count"])]
        for c in rows], empty="no consumers") + more_c
    trows = []
    names, more_t = capped(v["topics"], api)
    for t in names:
        if v["tombstone_note"]:
            act = ""
        elif v["tombstones"].get(t):
            act = '<span class="tag">tombstoned</span>'
        else:
            act = form(f"/topics/{u(t)}/tombstone", "tombstone", ctx,
                       confirm=f"Tombstone topic {t} on {http}? Lookups stop naming this "
                               "node for it.",
                       fields=f'<input type="hidden" name="node" value="{esc(http)}">')
        trows.append([f'<a href="/topics/{u(t)}">{esc(t)}</a>', act])
    topics = table(["topic", "tombstone"], trows, cls="node-topics",
                   empty="no topics") + more_t
    tnote = f'<p class="note" id="tombstone-note">{esc(v["tombstone_note"])}</p>' \
        if v["tombstone_note"] else ""
    rnote = f'<p class="note">{esc(v["replication_note"])}</p>' if v["replication_note"] else ""
    drain = _drain_html(v, ctx) if v["mode"] == "cluster" and v["node_id"] else ""
    return f"Node {http}", (
        f'<h1>Node <span class="name">{esc(http)}</span></h1>{_age(v)}<dl>{dl}</dl>{drain}'
        f'<h2>Partitions led</h2>{rnote}{led}<h2>Partitions followed</h2>{following}'
        f'<h2>Clients</h2>{clients}<h2>Topics</h2>{tnote}{topics}')


def _search_form(q: dict) -> str:
    def field(name, label, ph):
        return (f'<label>{label}<input name="{name}" value="{esc(q.get(name, ""))}" '
                f'placeholder="{esc(ph)}"></label>')
    return ('<form method="get" action="/trace" class="search">'
            + field("msg_id", "message id", "16 hex characters")
            + field("trace_id", "trace id", "decimal")
            + field("topic", "topic", "") + field("channel", "channel", "")
            + field("since", "since", "-15m or 2026-11-26T10:00")
            + field("until", "until", "now") + field("limit", "limit", "1000")
            + '<button type="submit">search</button></form>')


def _tracing_off(v: dict, ctx: dict) -> str:
    """Why a topic search finds nothing new: tracing is off for it, and the switch."""
    topic = v["query"]["topic"]
    return (f'<div class="note" id="tracing-off"><p>tracing is off for topic '
            f'<b>{esc(topic)}</b>: its messages are recorded only while tracing is on, so a '
            f'search finds none published while it is off. Turn it on here, or on the topic '
            f'page (the "tracing on" button).</p>'
            + form(f"/topics/{u(topic)}/trace_on", "tracing on", ctx) + "</div>")


def trace_page(v: dict | None, raw: dict, error: str, ctx: dict) -> tuple[str, str]:
    out = ["<h1>Trace search</h1>", _search_form(raw)]
    if error:
        out.append(f'<p class="error" id="search-error">{esc(error)}</p>')
    if v is None:
        return "Trace", "".join(out)
    if v["status"] != 200:
        out.append(f'<p class="error" id="search-error">{esc(v["message"])}'
                   f'{": " + esc(v["detail"]) if v["detail"] else ""}</p>')
    else:
        out.append(f'<p id="search-count">{count(v["count"], "event")}, '
                   f'{count(len(v["messages"]), "message")} · nodes asked: '
                   f'{esc(", ".join(v["nodes"]))}</p>')
    if v.get("traced") is False:
        out.append(_tracing_off(v, ctx))
    if v["unreachable"]:
        out.append(f'<p class="bad">unreachable: {esc(", ".join(v["unreachable"]))}</p>')
    for m in v["messages"]:
        rows = [[esc(iso(e["time_ns"] / 1e9)), f'+{e.get("since_first_ms", 0):g} ms',
                 esc(e.get("kind", "")), esc(e.get("channel", "")), node_link(e.get("node", "")),
                 esc(e.get("what", ""))] for e in m.get("events", ())]
        if m.get("body_text") is not None:
            body = f'<pre class="body text">{esc(m["body_text"])}</pre>'
        elif m.get("body_hex") is not None:
            body = f'<pre class="body hex">{esc(m["body_hex"])}</pre><small>binary: hex</small>'
        else:
            body = f'<p class="note">body: {esc(m.get("body_error", "not fetched"))}</p>'
        topic = m.get("topic", "")
        out.append(
            f'<section class="timeline" data-msg-id="{esc(m.get("msg_id", ""))}">'
            f'<h2>message {esc(m.get("msg_id", ""))} <small><a href="/topics/{u(topic)}">'
            f'{esc(topic)}</a> partition {num(m.get("partition", "?"))} · trace id '
            f'{esc(str(m.get("trace_id", "")))} · '
            f'{"finished" if m.get("finished") else "not finished"}</small></h2>'
            f'<p class="story">{esc(m.get("story", ""))}</p>'
            + table(["time", "after first", "event", "channel", "node", "what"], rows)
            + body + "</section>")
    return "Trace", "".join(out)


def login_page(ctx: dict, next_url: str, error: str = "") -> tuple[str, str]:
    err = f'<p class="error" id="login-error">{esc(error)}</p>' if error else ""
    return "Log in", (
        f'<h1>Log in</h1>{err}<form method="post" action="/login" class="login">'
        f'<input type="hidden" name="csrf" value="{esc(ctx["csrf"])}">'
        f'<input type="hidden" name="next" value="{esc(next_url)}">'
        f'<label>user<input name="user" autocomplete="username" required></label>'
        f'<label>password<input name="password" type="password" '
        f'autocomplete="current-password" required></label>'
        f'<button type="submit">log in</button></form>')


def error_page(status: int, code: str, detail: str) -> tuple[str, str]:
    return f"{status} {code}", (f'<h1 class="error-title">{status} {esc(code)}</h1>'
                                f'<p id="error-detail">{esc(detail)}</p>'
                                f'<p><a href="/">back to the topics</a></p>')
