"""The admin key (--admin-secret-file, nsqwire/adminkey.py) from outside, on real processes:
every HTTP call that changes state on nsqd and nsqlookupd (each route of their tables but
a GET, and but the publishing ones on nsqd: /pub, /mpub, /half and its decisions) is refused without the key (401
ADMIN_KEY_REQUIRED) and with a wrong one (403 ADMIN_KEY_INVALID) and reaches its handler
with it; a refused call changes nothing; reads and publishing stay open; a cluster with
the key on every daemon still works through the master nsqlookupd (which sends the key to
nsqd for /channel/setoffset) and through nsqadmin; nsqd's --https-address serves the API
over TLS, and with --tls-required=true its plain listener takes GETs only."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request

import pytest

from admin_env import Client, NsqadminProcess
from cluster import Cluster, wait_until
from compat.compat_util import make_self_signed_cert
from servers import NsqdProcess, NsqlookupdProcess, free_port

SECRET = "k3y-0f-the-admins"


def secret_file(root) -> str:
    path = os.path.join(str(root), "admin.secret")
    with open(path, "w") as f:
        f.write(SECRET + "\n")
    return path


def call(method: str, url: str, key: str | None = None, body: bytes | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, object]:
    """(status, JSON body or text) of one call; `key` sent as the Bearer admin key."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if body is None and method != "GET":
        body = b""
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def writes(routes: dict, open_paths=()) -> list[tuple[str, str]]:
    """(method, path) of every route that is not a GET and not open."""
    return [(m, p) for p, methods in routes.items() for m in methods
            if m != "GET" and p not in open_paths]


def assert_guarded(base: str, method: str, path: str) -> None:
    """Refused without the key and with a wrong one; taken by the handler with it."""
    assert call(method, base + path) == (401, {"message": "ADMIN_KEY_REQUIRED"}), path
    assert call(method, base + path, "wrong") == (403, {"message": "ADMIN_KEY_INVALID"}), path
    status, body = call(method, base + path, SECRET)
    assert status not in (401, 403), (path, status, body)


def nsqd_routes() -> dict:
    from nsqd import http, readhttp, tracehttp
    return {**http.ROUTES, **tracehttp.ROUTES, **readhttp.ROUTES,
            "/config/nsqlookupd_tcp_addresses": {"GET": None, "PUT": None}}


def depth(base: str, topic: str, channel: str) -> int | None:
    """The channel's depth on this node, or None when the topic or channel is not there."""
    status, stats = call("GET", f"{base}/stats?format=json&topic={topic}")
    for t in stats["topics"] if status == 200 else ():
        for c in t["channels"]:
            if t["topic_name"] == topic and c["channel_name"] == channel:
                return c["depth"]
    return None


def sync_every(base: str, topic: str) -> int:
    """The topic's partition 0 sync policy: messages per sync."""
    stats = call("GET", f"{base}/stats?format=json&topic={topic}")[1]
    return stats["topics"][0]["partitions"][0]["sync_every"]


def test_nsqd_state_changes_need_the_key(tmp_path):
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), "--admin-secret-file",
                       secret_file(tmp_path)).start()
    try:
        base = f"http://{nsqd.http_address}"
        from nsqd.http import PUBLISH
        assert PUBLISH == {"/pub", "/mpub", "/half", "/half/commit", "/half/rollback"}
        guarded = writes(nsqd_routes(), PUBLISH)
        assert ("POST", "/topic/delete") in guarded
        assert ("PUT", "/config/nsqlookupd_tcp_addresses") in guarded
        for method, path in guarded:
            assert_guarded(base, method, path)

        assert call("POST", f"{base}/channel/create?topic=t&channel=c") == \
            (401, {"message": "ADMIN_KEY_REQUIRED"})
        assert depth(base, "t", "c") is None  # the refused create made nothing
        assert call("POST", f"{base}/topic/create?topic=t", SECRET)[0] == 200
        assert call("POST", f"{base}/channel/create?topic=t&channel=c", SECRET)[0] == 200
        # publishing is data, not admin: open; reads too
        assert call("POST", f"{base}/pub?topic=t", body=b"one") == (200, "OK")
        assert call("POST", f"{base}/mpub?topic=t", body=b"two\nthree") == (200, "OK")
        assert depth(base, "t", "c") == 3
        half = call("POST", f"{base}/half?topic=t&check_url=http://127.0.0.1:9/", body=b"h")
        assert half[0] == 200, half
        assert call("POST", f"{base}/half/commit?topic=t&id={half[1]['id']}") == (
            200, {"state": "committed"})
        assert call("GET", f"{base}/config/nsqlookupd_tcp_addresses") == (200, [])

        # refused calls change nothing
        for path in ("/channel/empty?topic=t&channel=c", "/channel/delete?topic=t&channel=c",
                     "/topic/delete?topic=t", "/topic/empty?topic=t",
                     "/topic/create?topic=t&sync_every=1000"):
            assert call("POST", base + path, "wrong")[0] == 403
        assert call("PUT", f"{base}/config/nsqlookupd_tcp_addresses", "wrong",
                    b'["127.0.0.1:1"]')[0] == 403
        assert depth(base, "t", "c") == 5  # and the half and its commit, records unread
        assert call("GET", f"{base}/config/nsqlookupd_tcp_addresses") == (200, [])
        assert sync_every(base, "t") == 1  # the refused create left every batch synced
        assert call("POST", f"{base}/topic/create?topic=t&sync_every=1000", SECRET)[0] == 200
        assert sync_every(base, "t") == 1000

        assert call("POST", f"{base}/channel/empty?topic=t&channel=c", SECRET)[0] == 200
        assert depth(base, "t", "c") == 0
        assert call("POST", f"{base}/topic/delete?topic=t", SECRET)[0] == 200
        assert call("GET", f"{base}/stats?format=json&topic=t")[1]["topics"] == []
    finally:
        nsqd.stop()


def test_nsqlookupd_state_changes_need_the_key(tmp_path):
    lookupd = NsqlookupdProcess(str(tmp_path), "--admin-secret-file",
                                secret_file(tmp_path)).start()
    try:
        base = f"http://{lookupd.http_address}"
        from nsqlookupd import http, tracesearch
        guarded = writes({**http.ROUTES, **tracesearch.ROUTES})
        assert len(guarded) == 5
        for method, path in guarded:
            assert_guarded(base, method, path)
        assert call("POST", f"{base}/topic/create?topic=kept", SECRET)[0] == 200
        assert call("POST", f"{base}/topic/delete?topic=kept")[0] == 401
        assert call("POST", f"{base}/topic/delete?topic=kept", "wrong")[0] == 403
        assert call("GET", f"{base}/topics") == (200, {"topics": ["kept"]})
        assert call("POST", f"{base}/topic/delete?topic=kept", SECRET)[0] == 200
        assert call("GET", f"{base}/topics") == (200, {"topics": []})
    finally:
        lookupd.stop()


@pytest.mark.parametrize("text", ["", "two words\n", "\n\n"])
def test_a_bad_secret_file_is_refused_at_start(tmp_path, text):
    path = tmp_path / "secret"
    path.write_text(text)
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), "--admin-secret-file", str(path))
    with pytest.raises(RuntimeError, match="admin-secret-file"):
        nsqd.start()


def test_cluster_with_the_key_everywhere(tmp_path):
    """etcd, one nsqlookupd and two nsqd, each with the key: topics made through the master
    nsqlookupd, its setoffset fanned out to nsqd (the lookupd sends the key), and
    nsqadmin's actions (it sends the key) work; an nsqadmin without the key cannot act."""
    secret = secret_file(tmp_path)
    c = Cluster(str(tmp_path / "c"), 2, 1, "--admin-secret-file", secret)
    c.lookupds[0].extra += ["--admin-secret-file", secret]
    admins = []
    try:
        c.start()
        lookupd = f"http://{c.lookupds[0].http_address}"
        from nsqlookupd import cluster_http
        for method, path in writes(cluster_http.ROUTES):
            assert call(method, lookupd + path) == (401, {"message": "ADMIN_KEY_REQUIRED"})
            assert call(method, lookupd + path, "wrong")[0] == 403
        assert c.create_topic("orders", 2)[0] == 401
        assert c.lookup("orders") == {}

        wait_until(lambda: call("POST", f"{lookupd}/topic/create?topic=orders&partition_num=2",
                                SECRET)[0] == 200, 15, "the topic made by the master")
        wait_until(lambda: call("POST", f"{lookupd}/channel/create?topic=orders&channel=ch",
                                SECRET)[0] == 200, 15, "the channel made")
        status, body = call("POST", f"{lookupd}/channel/setoffset?topic=orders&channel=ch",
                            SECRET, b"end")
        assert status == 200 and len(body["partitions"]) == 2, body

        admins = [NsqadminProcess(str(tmp_path / "admin.log"), "--lookupd-http-address",
                                  c.lookupds[0].http_address, "--admin-secret-file", secret),
                  NsqadminProcess(str(tmp_path / "nokey.log"), "--lookupd-http-address",
                                  c.lookupds[0].http_address)]
        for a in admins:
            a.start()
        keyed, keyless = Client(admins[0].url), Client(admins[1].url)
        for admin in (keyed, keyless):  # a first poll the loaded machine let time out: again
            wait_until(lambda: admin.get("/api/cluster")[1].get("mode") == "cluster", 15,
                       "nsqadmin sees the cluster")
        status, out, _ = keyless.post("/api/topics", {"topic": "refused", "partitions": 1})
        assert status != 200 and "ADMIN_KEY_REQUIRED" in json.dumps(out), out
        status, out, _ = keyed.post("/api/topics", {"topic": "made", "partitions": 1})
        assert status == 200, out
        assert keyed.post("/api/topics/made/channel_create", {"channel": "w"})[0] == 200
        assert keyed.post("/api/topics/made/w/pause")[0] == 200
        wait_until(lambda: keyed.get("/api/topics/made/w")[1].get("paused") is True, 10,
                   "the channel paused")
        wait_until(lambda: keyless.get("/api/topics/made/w")[0] == 200, 10,
                   "the keyless nsqadmin sees the channel")
        status, out, _ = keyless.post("/api/topics/made/w/unpause")
        assert status != 200 and "ADMIN_KEY_REQUIRED" in json.dumps(out), out
        assert keyed.get("/api/topics/made/w")[1]["paused"] is True
        assert keyed.post("/api/topics/made/delete")[0] == 200
        assert keyed.get("/api/topics/made")[0] == 404
    finally:
        for a in admins:
            a.stop()
        c.stop()


def test_https_listener_and_tls_required(tmp_path):
    cert, key = make_self_signed_cert(str(tmp_path / "tls"))
    https_port = free_port()
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), "--tls-cert", cert, "--tls-key", key,
                       "--https-address", f"127.0.0.1:{https_port}", "--tls-required=true",
                       "--admin-secret-file", secret_file(tmp_path)).start()
    try:
        tls = ssl.create_default_context(cafile=cert)
        https, plain = f"https://127.0.0.1:{https_port}", f"http://{nsqd.http_address}"
        assert call("POST", f"{https}/topic/create?topic=t", context=tls) == \
            (401, {"message": "ADMIN_KEY_REQUIRED"})
        assert call("POST", f"{https}/topic/create?topic=t", SECRET, context=tls)[0] == 200
        assert call("POST", f"{https}/pub?topic=t", body=b"m", context=tls) == (200, "OK")
        refused = (403, {"message": "TLS_REQUIRED", "https_port": https_port})
        assert call("POST", f"{plain}/topic/delete?topic=t", SECRET) == refused
        assert call("POST", f"{plain}/pub?topic=t", body=b"m") == refused
        status, stats = call("GET", f"{plain}/stats?format=json&topic=t")  # reads stay open
        assert status == 200 and stats["topics"][0]["message_count"] == 1
        status, stats = call("GET", f"{https}/stats?format=json&topic=t", context=tls)
        assert status == 200 and stats["topics"][0]["message_count"] == 1
    finally:
        nsqd.stop()
