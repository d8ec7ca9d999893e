"""The report folder of a run: summary.json, latency.png and throughput.png (fault windows
shaded), index.html linking them, the history and the logs."""

from __future__ import annotations

import html
import json
import os

from jepsen.checker import fault_windows, pairs

COLORS = {"ok": "#2a9d4b", "fail": "#d62728", "info": "#ff9f1c"}
FAULT_COLORS = {"kill": "#d62728", "pause": "#9467bd", "partition": "#1f77b4",
                "restart": "#8c564b", "disk-full": "#7f7f7f",
                "power-cut": "#e6b800", "etcd-pause": "#17becf", "clock-skew": "#bcbd22"}


def _shade(ax, windows: list[dict], end: float) -> None:
    labelled = set()
    for w in windows:
        kind = w.get("kind", "?")
        ax.axvspan(w["start"], w["end"] if w["end"] is not None else end, alpha=0.15,
                   color=FAULT_COLORS.get(kind, "grey"),
                   label=None if kind in labelled else f"fault: {kind}")
        labelled.add(kind)


def plots(history: list[dict], folder: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = fault_windows(history)
    end = max((op["time"] for op in history), default=1.0)
    done = pairs(history)
    fig, ax = plt.subplots(figsize=(11, 4))
    for kind in ("ok", "info", "fail"):
        pts = [(inv["time"], 1000 * ((d["time"] if d else end) - inv["time"]))
               for inv, d in done if (d["type"] if d else "info") == kind]
        if pts:
            ax.scatter(*zip(*pts), s=3, color=COLORS[kind], label=f"enqueue {kind}")
    _shade(ax, windows, end)
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("enqueue latency by outcome")
    ax.legend(loc="upper right", fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "latency.png"), dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    seconds = range(int(end) + 1)
    for kind in ("ok", "info", "fail"):
        counts = [0] * len(seconds)
        for inv, d in done:
            if (d["type"] if d else "info") == kind and int(inv["time"]) < len(counts):
                counts[int(inv["time"])] += 1
        ax.plot(list(seconds), counts, color=COLORS[kind], label=f"enqueue {kind}/s")
    deq = [0] * len(seconds)
    for op in history:
        if op["f"] == "dequeue" and int(op["time"]) < len(deq):
            deq[int(op["time"])] += 1
    ax.plot(list(seconds), deq, color="black", linewidth=0.8, label="dequeue/s")
    _shade(ax, windows, end)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("operations per second")
    ax.set_title("throughput")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "throughput.png"), dpi=90)
    plt.close(fig)
    return ["latency.png", "throughput.png"]


def _fault_row(w: dict) -> str:
    end = "" if w["end"] is None else f"{w['end']:.1f}"
    cells = [f"{w['start']:.1f}", end, w.get("kind"), w.get("mode"),
             ", ".join(w.get("hosts", [])), w.get("partitions", [])]
    return "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"


def write(folder: str, history: list[dict], results: dict, run: dict) -> str:
    summary = {"run": run, "valid": results["valid"], **{
        k: v for k, v in results.items() if k != "valid"}}
    summary["availability"] = {k: v for k, v in results["availability"].items()
                               if k != "per_second"}
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    images = plots(history, folder)
    tq, av, fo = results["total_queue"], results["availability"], results["failover"]
    verdict = "PASS" if results["valid"] else "FAIL"
    rows = [("lost (must be 0)", tq["lost"]), ("unexpected (must be 0)", tq["unexpected"]),
            ("stored twice, idempotent producers (must be 0)", tq["named_stored_twice"]),
            ("stored twice, all producers", tq["stored_twice"]),
            ("acknowledged enqueues", tq["acknowledged"]),
            ("indeterminate (info)", tq["indeterminate"]), ("failed", tq["failed"]),
            ("dequeued (distinct)", tq["dequeued"]), ("duplicated", tq["duplicated"]),
            ("duplicate rate", tq["duplicate_rate"]),
            ("poison acknowledged; dead letters (--poison)",
             f'{tq["poison_acknowledged"]}; {tq["dead"]}'),
            ("dead letters buried twice; not poison", f'{tq["dead_twice"]}; '
                                                       f'{tq["dead_not_poison"]}'),
            ("rolled-back halves delivered (must be 0)", tq["rolled_back_delivered"]),
            ("halves; acknowledged; check-backs answered (--halves)",
             f'{tq["halves"]}; {tq["halves_acknowledged"]}; {tq["check_backs"]}'),
            ("order", results["order"]["valid"]),
            ("enqueue success rate", av["success_rate"]),
            ("latency p50 / p99 / max (ms)", " / ".join(str(v) for v in
                                                        av["latency_ms"].values())),
            ("failover median / max (s)", f"{fo['median_s']} / {fo['max_s']}")]
    lv = results.get("liveness") or {}
    if lv.get("valid") != "skipped" and lv:
        rows.append(("partitions never writable after the heal (must be none)",
                     lv.get("never")))
    rp = results.get("replicas") or {}
    if rp.get("valid") == "skipped" or not rp:
        rows.append(("replicas", rp.get("why", "skipped")))
    else:
        rows += [("divergent records (must be 0)", rp["divergent"]),
                 ("missing from an ISR replica (must be 0)", rp["missing"]),
                 ("acknowledged not in a committed log (must be 0)",
                  rp["acknowledged_not_in_log"]),
                 ("records compared", rp["records_compared"]),
                 ("ISR full after the heal (s)", rp["isr_full_s"]),
                 ("message ids written twice", rp["duplicated_in_log"])]
    faults = "".join(_fault_row(w) for w in fault_windows(history))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>jepsen {verdict}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} td,th{{padding:2px 10px;text-align:left}}
.PASS{{color:#2a9d4b}} .FAIL{{color:#d62728}} table{{border-collapse:collapse}}
tr:nth-child(even){{background:#f3f3f3}}</style></head><body>
<h1>jepsen run: <span class="{verdict}">{verdict}</span></h1>
<p>{html.escape(json.dumps(run))}</p>
<table>{''.join(f'<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>'
                for k, v in rows)}</table>
{''.join(f'<p><img src="{i}"></p>' for i in images)}
<h2>Faults</h2><table><tr><th>start (s)</th><th>end (s)</th><th>kind</th><th>mode</th>
<th>hosts</th><th>partitions led</th></tr>{faults}</table>
<p><a href="summary.json">summary.json</a> · <a href="history.jsonl">history.jsonl</a> ·
<a href="logs/">logs/</a></p></body></html>"""
    path = os.path.join(folder, "index.html")
    with open(path, "w") as f:
        f.write(page)
    return path
