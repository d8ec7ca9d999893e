"""The Elasticsearch trace sink (--trace-es-url, trace/es.py) on real nsqd processes.

The store is osmem-server (a real in-memory OpenSearch-API server, PyPI), reached through
tests/esproxy.py's MediaTypeProxy (two headers rewritten; see there why). With
NSQ_TEST_ES_URL set (http://host:9200) the same tests run against that real
Elasticsearch instead, nsqd talking to it directly (the outage test through the proxy,
which it switches off). Each test writes indices of its own prefix.

test_trace.py's end-to-end tests that are not about SQLite itself run here again with
the ES store: each event kind, search by id, trace id, topic + time window, channel,
limit, the 404s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid

import pytest

from esproxy import MediaTypeProxy
from servers import NsqdProcess, free_port
from nodes import take
from nsqd.options import from_args
from test_trace import (  # noqa: F401 (collected again here, with this module's `traced`)
    conn, events_of, gone, http, ok, settled, test_a_message_timeline_has_each_event_when_it_happens,
    test_delay_queue_and_drops, test_off_by_default_and_per_channel_switch,
    test_setoffset_is_a_replay, test_switches_and_store_survive_a_restart_and_time_window,
    test_trace_ids_from_pub_trace_mpub_trace_pub_ext_and_http, test_unknown_ids_are_404_and_bad_arguments_400)

REAL_ES = os.environ.get("NSQ_TEST_ES_URL")


def osmem_binary() -> str | None:
    try:
        import osmem_server
        return osmem_server.resolve_binary()
    except (ImportError, RuntimeError):  # not installed, or no binary for this platform
        return None


class Osmem:
    """osmem-server on a port of its own; stop() and start() keep the port (its data is in
    memory: a restart begins empty)."""

    def __init__(self):
        self.port = free_port()
        self.proc = None

    def start(self) -> "Osmem":
        self.proc = subprocess.Popen(
            [osmem_binary(), "-addr", f"127.0.0.1:{self.port}", "-no-stdin-watch",
             "-parent-pid", str(os.getpid())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import urllib.request
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=1).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def es_store():
    """(url nsqd uses, proxy, osmem or None): a real ES when NSQ_TEST_ES_URL is set."""
    if REAL_ES:
        proxy = MediaTypeProxy(REAL_ES.split("://", 1)[1].rstrip("/")).start()
        yield REAL_ES, proxy, None
        proxy.close()
        return
    if osmem_binary() is None or not shutil.which(osmem_binary()):
        pytest.skip("osmem-server not installed (pip install osmem-server) and "
                    "NSQ_TEST_ES_URL not set: no Elasticsearch to test against")
    osmem = Osmem().start()
    proxy = MediaTypeProxy(f"127.0.0.1:{osmem.port}").start()
    yield proxy.url, proxy, osmem
    proxy.close()
    osmem.stop()


@pytest.fixture
def traced(tmp_path, es_store):
    """test_trace's fixture, with the store in Elasticsearch (indices of this test's own)."""
    url = es_store[0]
    prefix = f"nsq-trace-{uuid.uuid4().hex[:8]}-"
    procs = []

    def start(*extra, es_url=url):
        proc = NsqdProcess(str(tmp_path / "nsqd"), "--msg-timeout", "1s", "--trace-es-url",
                           es_url, "--trace-es-index-prefix", prefix, *extra).start()
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        p.kill()


async def test_stats_and_metrics_name_the_sink_and_no_sqlite_file(traced):
    node = traced("--trace-all")
    ok(node, "POST", "/pub?topic=named", b"x")
    events = await events_of(node, "topic=named", 1)
    assert [e["kind"] for e in events] == ["PUB"]
    t = await settled(node)
    assert t["sink"] == "elasticsearch" and t["store"].startswith("http") and t["written"] == 1
    assert 'nsqd_trace_sink{sink="elasticsearch"} 1' in ok(node, "GET", "/metrics")
    assert not os.path.exists(os.path.join(node.data_path, "trace.sqlite"))


async def test_sink_down_10s_loses_no_message_counts_drops_and_resumes(traced, es_store):
    _, proxy, osmem = es_store
    real_upstream = proxy.upstream
    node = traced("--trace-all", "--trace-buffer", "200", "--msg-timeout", "60s",
                  es_url=proxy.url)
    ok(node, "POST", "/pub?topic=outage", b"before")
    sub = await conn(node, output_buffer_timeout=-1)  # each delivery at once: the loop is paced
    await sub.sub("outage", "ch", rdy=200)
    (await take(sub))[0].fin()
    await events_of(node, "topic=outage", 3)
    before = await settled(node)
    assert before["written"] == 3 and before["dropped"] == 0

    if osmem is not None:  # the server itself goes away (and comes back empty)
        osmem.stop()
    else:  # a real ES cannot be stopped from here: the proxy in front of it answers 502
        proxy.upstream = f"127.0.0.1:{free_port()}"
    down_at = time.monotonic()
    pub = await conn(node)
    slowest, got = 0.0, []
    for i in range(150):  # 450 events over about 10 s, past the buffer of 200
        started = time.monotonic()
        await pub.pub("outage", b"m%d" % i)
        slowest = max(slowest, time.monotonic() - started)
        got += await take(sub, timeout=20)
        got[-1].fin()
        await asyncio.sleep(max(0.0, down_at + (i + 1) * 10 / 150 - time.monotonic()))
    assert sorted(m.body for m in got) == sorted(b"m%d" % i for i in range(150))
    assert slowest < 2.0, slowest  # no publish waited for the store
    during = ok(node, "GET", "/stats?format=json")["trace"]
    assert during["written"] == 3 and during["retries"] > 0 and during["error"]
    assert during["dropped_full"] > 0 and during["buffered"] == 200, during

    if osmem is not None:
        osmem.start()
    else:
        proxy.upstream = real_upstream
    t = await settled(node)
    shipped = t["written"] - before["written"]
    # every event made is shipped or counted: PUB, DELIVER, FIN of 150 messages
    assert shipped >= 200 and shipped + t["dropped_full"] == 3 * 150, t
    assert t["dropped_failed"] == 0 and t["error"] is None
    metrics = ok(node, "GET", "/metrics")
    assert f'nsqd_trace_events_dropped_total{{reason="buffer_full"}} {t["dropped_full"]}' in metrics
    since = time.time()
    # what was shipped is in the store, once each (retried bulks reuse their ids)
    outage = await events_of(node, f"topic=outage&until={since}&limit=10000",
                             shipped + (0 if osmem is not None else 3))
    assert len(outage) == shipped + (0 if osmem is not None else 3)
    ok(node, "POST", "/pub?topic=outage", b"after")  # shipping resumed
    (await take(sub))[0].fin()
    assert [e["kind"] for e in await events_of(node, f"topic=outage&since={since}", 3)] == [
        "PUB", "DELIVER", "FIN"]
    await pub.close()
    await sub.close()


async def test_store_process_killed_while_a_bulk_waits_writes_each_event_once(traced, es_store):
    """The sink's own process (trace/process.py) killed after the server wrote a bulk and
    before its answer came: a new process sends the batch again with the same `_id`s (no
    duplicate), and it too ends with the node."""
    proxy = es_store[1]
    node = traced("--trace-all", es_url=proxy.url)
    ok(node, "POST", "/pub?topic=killed", b"one")
    await events_of(node, "topic=killed", 1)
    [child] = node.trace_store_pids()
    proxy.bulk_answers.clear()
    ok(node, "POST", "/pub?topic=killed", b"two")
    held = await asyncio.to_thread(proxy.bulk_held.wait, 10)
    os.kill(child, 9)
    proxy.bulk_answers.set()
    assert held and gone(child)
    deadline = time.monotonic() + 10
    while (t := ok(node, "GET", "/stats?format=json")["trace"])["written"] < 2:
        assert time.monotonic() < deadline, t
        await asyncio.sleep(0.05)
    assert t["retries"] >= 1 and t["dropped"] == 0 and t["error"] is None, t
    events = await events_of(node, "topic=killed", 2)
    assert [e["kind"] for e in events] == ["PUB", "PUB"], events  # the resent one once
    [again] = node.trace_store_pids()
    assert again != child
    node.proc.kill()  # kill -9 of the node: the child sees the end of its input and exits
    assert gone(again)


async def test_search_is_503_while_the_store_is_unreachable(traced, es_store):
    proxy = es_store[1]
    node = traced("--trace-all", es_url=proxy.url)
    real_upstream = proxy.upstream
    proxy.upstream = f"127.0.0.1:{free_port()}"
    status, data = await asyncio.to_thread(http, node, "GET", "/trace/search?topic=t")
    proxy.upstream = real_upstream
    assert status == 503 and data["message"] == "TRACE_STORE_UNAVAILABLE"


@pytest.mark.parametrize("argv", [["--trace-es-url", "localhost:9200"],
                                  ["--trace-es-url", "http://es"],
                                  ["--trace-es-url", "ftp://es:21"],
                                  ["--trace-es-index-prefix", "Trace*"],
                                  ["--trace-es-url", "http://es:9200", "--trace-es-username", "u"],
                                  ["--trace-es-url", "http://es:9200", "--trace-es-username", "u",
                                   "--trace-es-password-file", "/nonexistent/pw"],
                                  ["--trace-es-url", "http://es:9200", "--trace-es-username", "u",
                                   "--trace-es-password-file", "/etc/hostname",
                                   "--trace-es-api-key-file", "/etc/hostname"],
                                  ["--trace-es-api-key-file", "/etc/hostname"]])
def test_bad_es_flags_are_refused_at_start(argv):
    with pytest.raises(ValueError, match="--trace-es|not a readable file"):
        from_args(argv)


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files), made with `cryptography`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(folder, "es.crt"), os.path.join(folder, "es.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


async def test_https_checked_against_a_ca_file_with_basic_auth_or_an_api_key(tmp_path,
                                                                             es_store):
    """--trace-es-url https://... with --trace-es-ca-certs: events reach the store with the
    user and password (or the API key) in every request; without the CA file the server's
    certificate is refused: the events are counted as not written, the node serves on."""
    if es_store[2] is None:
        pytest.skip("the https proxy stands in front of osmem-server only")
    import base64

    cert, key = self_signed(tmp_path)
    proxy = MediaTypeProxy(es_store[1].upstream, tls=(cert, key)).start()
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "key").write_text("aWQ6c2VjcmV0\n")
    runs = [("basic", ["--trace-es-username", "nsq", "--trace-es-password-file",
                       str(tmp_path / "pw")]),
            ("apikey", ["--trace-es-api-key-file", str(tmp_path / "key")])]
    try:
        for name, flags in runs:
            node = NsqdProcess(str(tmp_path / name), "--trace-all", "--trace-es-url", proxy.url,
                               "--trace-es-ca-certs", cert, "--trace-es-index-prefix",
                               f"tls-{name}-", *flags).start()
            try:
                ok(node, "POST", f"/pub?topic={name}", b"x")
                events = await events_of(node, f"topic={name}", 1)
                assert [e["kind"] for e in events] == ["PUB"], name
                [store] = node.trace_store_pids()  # the secrets went over its pipe
                with open(f"/proc/{store}/cmdline", "rb") as f:
                    argv = f.read()
                assert b"s3cret" not in argv and b"aWQ6c2VjcmV0" not in argv, argv
            finally:
                node.kill()
        basic = "Basic " + base64.b64encode(b"nsq:s3cret").decode()
        assert basic in proxy.authorizations and "ApiKey aWQ6c2VjcmV0" in proxy.authorizations
        assert set(proxy.authorizations) == {basic, "ApiKey aWQ6c2VjcmV0"}
        untrusting = NsqdProcess(str(tmp_path / "noca"), "--trace-all", "--trace-es-url",
                                 proxy.url, "--trace-es-index-prefix", "tls-noca-").start()
        try:
            ok(untrusting, "POST", "/pub?topic=noca", b"x")  # the publish is not slowed
            deadline = time.monotonic() + 20
            while "CERTIFICATE_VERIFY_FAILED" not in str(
                    ok(untrusting, "GET", "/stats?format=json")["trace"]["error"]):
                assert time.monotonic() < deadline, "no certificate error"
                await asyncio.sleep(0.2)
        finally:
            untrusting.kill()
    finally:
        proxy.close()


def test_retention_deletes_whole_daily_indices_past_the_age(es_store):
    from nsqtrace.es import EsStore, client, day_index, search
    prefix = f"nsq-trace-{uuid.uuid4().hex[:8]}-"
    store = EsStore(es_store[0], "node:4150", prefix)
    now = time.time_ns()
    day = 86_400 * 10**9
    old, recent = now - 10 * day, now - day // 2
    store.write([(old, "PUB", "kept", 0, "", 1, 0, 0, 0, "old"),
                 (recent, "PUB", "kept", 0, "", 2, 0, 0, 0, "recent")])
    es = client(es_store[0])
    for _ in range(50):  # a real ES shows writes after its refresh (1 s)
        if len(search(es, prefix, topic="kept")) == 2:
            break
        time.sleep(0.1)
    assert [e["detail"] for e in search(es, prefix, topic="kept")] == ["old", "recent"]
    store.retain(7 * 86_400, None, now_ns=now)
    names = set(es.indices.get(index=f"{prefix}*"))
    assert names == {day_index(prefix, recent)}, names
    assert [e["detail"] for e in search(es, prefix, topic="kept")] == ["recent"]
    es.indices.delete(index=day_index(prefix, recent))  # by name: ES refuses wildcards
    store.close()
    es.close()


async def test_nodes_sharing_the_store_each_answer_with_every_nodes_events(tmp_path, es_store):
    prefix = f"nsq-trace-{uuid.uuid4().hex[:8]}-"
    nodes = [NsqdProcess(str(tmp_path / name), "--trace-all", "--trace-es-url", es_store[0],
                         "--trace-es-index-prefix", prefix).start() for name in ("a", "b")]
    try:
        for node, body in zip(nodes, (b"from a", b"from b")):
            ok(node, "POST", "/pub?topic=shared", body)
        for node in nodes:
            events = await events_of(node, "topic=shared", 2)
            assert len(events) == 2 and {e["node"].rsplit(":", 1)[1] for e in events} == {
                str(n.tcp_port) for n in nodes}, events
    finally:
        for node in nodes:
            node.kill()
