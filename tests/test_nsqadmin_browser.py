"""nsqadmin in a real browser: Debian's chromium driven by Playwright (sync API, one
browser for the module; never `playwright install`), against one module-scoped cluster
(etcd, nsqlookupd, 3 nsqd) and a classic pair (nsqlookupd without etcd, one nsqd), with
an nsqadmin on each of: the cluster, the single nsqd (--nsqd-http-address, twice: open,
and with --admin-user), the classic lookupd.

Every page renders with real data; every action is clicked (confirm() dialogs accepted,
and one dismissed) and its effect shows on the page; a paused channel stops delivering to
a real consumer until unpaused; a message a raw consumer REQs is buried, shown on the dead
letters page and requeued by its button; a half message waits on the half messages page
(linked from the topic page) until its commit button delivers it; a trace search finds a
message published here; with --admin-user an action sends the browser to the login form
and back.

Screenshots of every page (laptop 1280 px wide, and the topic and channel pages at 390 px,
a phone) go to a tmp folder kept after the run: `<basetemp>/nsqadmin-shots0/*.png` (the
path is printed at the end, with each page's load time in the browser and the server's
render time from its Server-Timing header).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from admin_env import (PASSWORD, Classic, Client, NsqadminProcess, RawConsumer, ThreadConsumer,
                       password_file, post_nsqd, publish, publish_half, until)
from cluster import Cluster, wait_until

pw = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium not installed "
                                                         "(scripts/setup.sh)")
TIMINGS: list[tuple[str, float, float]] = []  # (page, browser load ms, server render ms)


@pytest.fixture(scope="module")
def env(module_dir, tmp_path_factory, request):
    root = str(module_dir)
    shots = str(tmp_path_factory.mktemp("nsqadmin-shots"))  # kept: module_dir goes
    c = Cluster(root + "/c", 3, 1, "--msg-timeout", "60s")
    classic = Classic(root + "/classic")
    admins = []
    try:
        c.start()
        classic.start()
        wait_until(lambda: c.master() is not None, 15, "a master nsqlookupd (cluster writes)")
        admins = [
            NsqadminProcess(f"{root}/cluster.log", "--lookupd-http-address",
                            c.lookupds[0].http_address),
            NsqadminProcess(f"{root}/single.log", "--nsqd-http-address",
                            classic.nsqd.http_address),
            NsqadminProcess(f"{root}/classic.log", "--lookupd-http-address",
                            classic.lookupd.http_address),
            NsqadminProcess(f"{root}/guarded.log", "--nsqd-http-address",
                            classic.nsqd.http_address, "--admin-user", "ops",
                            "--admin-password-file", password_file(root))]
        for a in admins:
            a.start()
        with pw.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM,
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                yield {"cluster": c, "classic": classic, "admin": admins[0],
                       "single": admins[1], "classic_admin": admins[2], "guarded": admins[3],
                       "browser": browser,
                       "shots": shots}
            finally:
                browser.close()
        lines = [f"nsqadmin page loads (browser load ms / server render ms); screenshots in "
                 f"{shots}"] + [f"  {name:<28} {load_ms:8.1f} ms  {render_ms:7.2f} ms"
                                for name, load_ms, render_ms in TIMINGS]
        with open(os.path.join(shots, "timings.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled():  # shown even when pytest captures
            print("\n" + "\n".join(lines), flush=True)
    finally:
        for a in admins:
            a.stop()
        classic.stop()
        c.stop()


@pytest.fixture
def page(env):
    context = env["browser"].new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(15000)
    pg.confirm = [True]  # the answer to confirm() of destructive actions
    pg.on("dialog", lambda d: d.accept() if pg.confirm[0] else d.dismiss())
    yield pg
    context.close()


def visit(env, pg, base: str, path: str, shot: str, status: int = 200):
    """Go to a page, record its load time and server render time, take its screenshot."""
    resp = pg.goto(base + path)
    assert resp.status == status, (path, resp.status, pg.content()[:500])
    nav = pg.evaluate("() => { const n = performance.getEntriesByType('navigation')[0];"
                      " return [n.loadEventEnd - n.startTime, (n.serverTiming.find("
                      "s => s.name === 'render') || {duration: -1}).duration]; }")
    TIMINGS.append((shot, nav[0], nav[1]))
    pg.screenshot(path=os.path.join(env["shots"], f"{shot}.png"), full_page=True)
    return resp


def text(pg, selector: str) -> str:
    return pg.locator(selector).first.inner_text()


def click(pg, label: str, within: str = "main"):
    pg.locator(f"{within} form.action button", has_text=label).first.click()
    pg.wait_for_load_state()


def test_every_page_with_real_data(env, page):
    c, base = env["cluster"], env["admin"].url
    api = Client(base)
    assert api.post("/api/topics", {"topic": "shop", "partitions": 3, "replicas": 2})[0] == 200
    assert api.post("/api/topics/shop/channel_create", {"channel": "mail"})[0] == 200
    leaders = wait_until(lambda: len(c.leaders("shop")) == 3 and c.leaders("shop"), 15,
                         "three leaders")
    for n, tcp in leaders.items():
        assert publish(c.nsqd_at(tcp).http_address, f"/pub?topic=shop&partition={n}",
                         b"order %d" % n) == 200
    until(lambda: api.get("/api/topics/shop")[1]["depth"] == 3, 10, "depth 3 in nsqadmin")
    time.sleep(1.2)  # a few samples for the sparklines

    visit(env, page, base, "/cluster", "cluster")
    assert page.locator("main table tbody tr").count() >= 4  # 1 lookupd + 3 nodes
    assert "healthy" in text(page, "main")
    assert page.locator("#load-note").count() == 0 or \
        text(page, "#load-note").startswith("load reports not available")

    visit(env, page, base, "/topics", "topics")
    row = page.locator("table.topics tr", has_text="shop")
    assert row.count() == 1 and "3" in row.inner_text()

    visit(env, page, base, "/topics/shop", "topic")
    rows = page.locator("table.partitions tbody tr")
    assert rows.count() == 3
    for i in range(3):
        cells = rows.nth(i).locator("td")
        assert cells.nth(2).locator("a").count() == 2  # ISR: two members, linked
        assert int(cells.nth(4).inner_text()) >= 1  # epoch
        assert cells.nth(7).inner_text().split() == ["1"]  # depth (and its chart)
    assert page.locator("svg.spark polyline").count() >= 2  # sparklines with samples
    assert "mail" in text(page, "table.channels")

    visit(env, page, base, "/topics/shop/mail", "channel")
    assert text(page, "#stat-depth") == "3" and text(page, "#ordered") == "no"
    for label in ("in flight", "deferred", "delayed", "requeued", "timed out"):
        assert page.locator(".stat span", has_text=label).count() == 1

    node = c.nsqd_at(leaders[0]).http_address
    visit(env, page, base, f"/nodes/{node}", "node")
    assert "shop" in text(page, "main") and node in text(page, "h1")
    visit(env, page, base, "/trace", "trace")
    assert page.locator("form.search").count() == 1
    visit(env, page, base, "/topics/no-such-topic", "404", status=404)
    assert "TOPIC_NOT_FOUND" in text(page, "h1")

    phone = env["browser"].new_page(viewport={"width": 390, "height": 844})
    for path, shot in (("/topics/shop", "topic-phone"), ("/topics/shop/mail", "channel-phone"),
                       ("/cluster", "cluster-phone"), ("/", "topics-phone")):
        visit(env, phone, base, path, shot)
        assert phone.evaluate("document.documentElement.scrollWidth") <= 390 + 1
    phone.close()

    # the page refreshes itself: a publish shows up without a reload
    page.goto(base + "/topics/shop/mail")
    assert publish(c.nsqd_at(leaders[0]).http_address, "/pub?topic=shop&partition=0",
                     b"more") == 200
    page.wait_for_function("document.querySelector('#stat-depth').innerText === '4'",
                           timeout=10000)


def test_pause_stops_a_real_consumer(env, page):
    c, base = env["cluster"], env["admin"].url
    page.goto(base + "/topics")
    page.fill("input[name=topic]", "pausing")
    page.fill("input[name=partitions]", "1")
    page.fill("input[name=replicas]", "2")
    click(page, "create topic")
    assert page.url.endswith("/topics/pausing") and "done" in text(page, ".flash")
    page.fill("input[name=channel]", "work")
    click(page, "create channel")
    assert page.url.endswith("/topics/pausing/work")
    leader = c.nsqd_at(wait_until(lambda: c.leaders("pausing").get(0), 15, "a leader"))
    consumer = ThreadConsumer(leader.tcp_address, "pausing", "work").start()
    try:
        assert publish(leader.http_address, "/pub?topic=pausing", b"before") == 200
        assert consumer.take(10)[1] == b"before"

        def client_row():
            page.reload()
            rows = page.locator("table.clients tbody tr")
            return rows.count() == 1 and rows.first.locator("td").nth(3).inner_text() == "10"
        until(client_row, 10, "the consumer listed with RDY 10")

        click(page, "pause")
        assert text(page, "#paused") == "yes" and page.locator(".tag.paused").count() == 1
        assert publish(leader.http_address, "/pub?topic=pausing", b"while paused") == 200
        assert consumer.take(1.5) is None, "a paused channel delivered"
        page.reload()
        assert text(page, "#stat-depth") == "1"

        click(page, "unpause")
        assert text(page, "#paused") == "no"
        assert consumer.take(10)[1] == b"while paused"
    finally:
        consumer.stop()


def test_every_action_shows_its_effect(env, page):
    c, base = env["cluster"], env["admin"].url
    page.goto(base + "/topics")
    page.fill("input[name=topic]", "acts")
    page.fill("input[name=partitions]", "1")
    click(page, "create topic")
    assert page.url.endswith("/topics/acts"), text(page, "body")
    page.fill("input[name=channel]", "ch")
    click(page, "create channel")
    assert page.url.endswith("/topics/acts/ch"), text(page, "body")
    leader = c.nsqd_at(wait_until(lambda: c.leaders("acts").get(0), 15, "a leader"))
    for i in range(3):
        assert publish(leader.http_address, "/pub?topic=acts", b"m%d" % i) == 200
    page.goto(base + "/topics/acts/ch")
    until(lambda: page.reload() and text(page, "#stat-depth") == "3", 10, "depth 3")

    page.confirm[0] = False  # "no" to the confirm(): nothing is sent
    page.locator("main form.action button", has_text="empty").click()
    time.sleep(0.3)
    page.reload()
    assert text(page, "#stat-depth") == "3"

    page.confirm[0] = True
    click(page, "empty")
    assert text(page, "#stat-depth") == "0"
    page.fill("input[name=time]", "-1h")
    click(page, "replay from")
    until(lambda: page.reload() and text(page, "#stat-depth") == "3", 10,
          "depth 3 again after the replay")
    page.fill("input[name=time]", "last tuesday")
    click(page, "replay from")
    assert "bad replay time" in text(page, "#error-detail")

    page.goto(base + "/topics/acts/ch")
    click(page, "tracing on")
    assert page.locator("h1 .tag.traced").count() == 1
    click(page, "tracing off")
    assert page.locator("h1 .tag.traced").count() == 0

    page.goto(base + "/topics/acts")
    click(page, "pause")
    assert page.locator("h1 .tag.paused").count() == 1
    click(page, "unpause")
    assert page.locator("h1 .tag.paused").count() == 0
    click(page, "tracing on")
    assert page.locator("h1 .tag.traced").count() == 1
    click(page, "empty")
    assert "topic empty acts: done" in text(page, ".flash")

    page.goto(base + "/topics/acts/ch")
    click(page, "delete")
    assert page.url.endswith("/topics/acts")
    # cluster-wide deletes reach the nodes through etcd: shown at once, or after a refresh
    until(lambda: page.locator("table.channels").count() == 0 or page.reload() and False,
          10, "the channel gone from the topic page", detail=lambda: text(page, "main"))
    click(page, "delete")
    assert page.url.endswith("/topics")
    until(lambda: page.locator("table.topics tr", has_text="acts").count() == 0
          or page.reload() and False, 10, "the topic gone from the list")


def test_dead_letters_page(env, page):
    """Max attempts set on the channel page; a message REQed once by a raw consumer shows on
    the dead letters page and on its own page; its requeue button delivers it again."""
    from nsqwire import commands

    c, base = env["cluster"], env["admin"].url
    api = Client(base)
    assert api.post("/api/topics", {"topic": "graves", "partitions": 1})[0] == 200
    assert api.post("/api/topics/graves/channel_create", {"channel": "ch"})[0] == 200
    leader = c.nsqd_at(wait_until(lambda: c.leaders("graves").get(0), 15, "a leader"))
    until(lambda: api.get("/api/topics/graves/ch")[1].get("partitions"), 10,
          "the channel's partition shown")
    page.goto(base + "/topics/graves/ch")
    page.fill("input[name=max_attempts]", "1")
    click(page, "set max attempts")
    assert page.url.endswith("/topics/graves/ch") and "done" in text(page, ".flash")
    assert page.input_value("input[name=max_attempts]") == "1"

    consumer = RawConsumer(leader.tcp_address, "graves", "ch")
    try:
        assert publish(leader.http_address, "/pub?topic=graves", b"<b>bad</b> order") == 200
        _, msg_id, _ = consumer.take()
        consumer.send(commands.cmd_req(msg_id, 0, "no stock"))
        until(lambda: api.get("/api/topics/graves/ch/dead")[1]["count"] == 1, 10, "buried")

        visit(env, page, base, "/topics/graves/ch/dead", "dead-letters")
        row = page.locator("table.dead-letters tbody tr")
        assert row.count() == 1 and "1 dead letter" in text(page, "#dead-count")
        cells = [td.inner_text() for td in row.first.locator("td").all()]
        assert cells[2:6] == [msg_id.decode(), "1", "req", "no stock"]
        assert cells[7] == "<b>bad</b> order"  # shown as text, never as markup
        row.first.locator("td a").first.click()
        page.wait_for_load_state()
        assert text(page, "pre.body.text") == "<b>bad</b> order"
        page.screenshot(path=os.path.join(env["shots"], "dead-letter.png"), full_page=True)

        page.goto(base + "/topics/graves/ch/dead")
        row.first.locator("button", has_text="requeue").click()
        page.wait_for_load_state()
        assert page.url.endswith("/topics/graves/ch/dead") and "done" in text(page, ".flash")
        assert "0 dead letters" in text(page, "#dead-count")
        attempts, _, body = consumer.take()  # delivered again, a fresh message
        assert (attempts, body) == (1, b"<b>bad</b> order")
    finally:
        consumer.close()


def test_half_messages_page(env, page):
    """A half message waiting shows on the topic page (its partition row and the link) and
    on the half messages page; its commit button delivers it to a real consumer."""
    c, base = env["cluster"], env["admin"].url
    api = Client(base)
    assert api.post("/api/topics", {"topic": "deals", "partitions": 1})[0] == 200
    assert api.post("/api/topics/deals/channel_create", {"channel": "ch"})[0] == 200
    leader = c.nsqd_at(wait_until(lambda: c.leaders("deals").get(0), 15, "a leader"))
    half_id = publish_half(leader.http_address, "deals", 0, b"<i>deal</i> 7")
    until(lambda: api.get("/api/topics/deals")[1]["half_waiting"] == 1, 10, "1 waiting")

    visit(env, page, base, "/topics/deals", "topic-halves")
    assert text(page, "#halves") == \
        "half messages: 1 waiting · 0 committed · 0 rolled back (0 expired)"
    assert text(page, "table.partitions tbody tr td:nth-child(10)").startswith("1 waiting")
    page.locator("#halves a").click()
    page.wait_for_load_state()
    assert page.url.endswith("/topics/deals/half")
    visit(env, page, base, "/topics/deals/half", "half-messages")
    assert text(page, "#half-count") == "1 half message waiting"
    row = page.locator("table.half-waiting tbody tr")
    cells = [td.inner_text() for td in row.first.locator("td").all()]
    assert row.count() == 1 and cells[0] == "0" and cells[2] == half_id, cells
    assert cells[5] == "http://127.0.0.1:9/never"

    consumer = ThreadConsumer(leader.tcp_address, "deals", "ch").start()
    try:
        assert consumer.take(0.5) is None  # waiting: delivered by no channel
        row.first.locator("button", has_text="commit").click()
        page.wait_for_load_state()
        assert page.url.endswith("/topics/deals/half") and "done" in text(page, ".flash")
        assert half_id in text(page, ".flash")
        assert text(page, "#half-count") == "0 half messages waiting"
        assert page.locator("table.half-partitions tbody tr td").nth(3).inner_text() == "1"
        assert consumer.take(10)[1] == b"<i>deal</i> 7"
    finally:
        consumer.stop()


def test_trace_search_finds_a_published_message(env, page):
    c, base = env["cluster"], env["admin"].url
    api = Client(base)
    assert api.post("/api/topics", {"topic": "tr", "partitions": 1})[0] == 200
    assert api.post("/api/topics/tr/trace_on")[0] == 200
    leader = c.nsqd_at(wait_until(lambda: c.leaders("tr").get(0), 15, "a leader"))
    until(lambda: "tr" in api.get(f"/api/nodes/{leader.http_address}")[1]["trace"]["topics"],
          10, "the leader follows the switch")
    for body in (b"where did I go?", b"\x00\x10binary\xff"):  # a new leader refuses (503)
        until(lambda: publish(leader.http_address, "/pub?topic=tr", body) == 200, 10,
              "published")  # until it applied its view: a client retries

    page.goto(base + "/trace")
    page.fill("input[name=topic]", "tr")
    page.fill("input[name=since]", "-5m")

    def found():
        page.locator("form.search button").click()
        page.wait_for_load_state()
        return page.locator("section.timeline").count() == 2
    until(found, 30, "both messages found by topic and window", interval=0.3,
          detail=lambda: api.get("/api/trace?topic=tr&since=-5m"))
    TIMINGS.append(("trace search (topic)", *page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0]; return "
        "[n.loadEventEnd - n.startTime, n.serverTiming[0].duration]; }")))
    page.screenshot(path=os.path.join(env["shots"], "trace-results.png"), full_page=True)
    first = page.locator("section.timeline").first
    assert text(first, "pre.body.text") == "where did I go?"
    assert "PUB" in first.locator("table").inner_text()
    assert "00 10 62 69 6e 61 72 79 ff" in text(page, "pre.body.hex")

    msg_id = first.get_attribute("data-msg-id")
    page.goto(base + "/trace")
    page.fill("input[name=msg_id]", msg_id)
    page.locator("form.search button").click()
    page.wait_for_load_state()
    assert page.locator("section.timeline").count() == 1 and msg_id in text(page, "h2")

    visit(env, page, base, "/trace?topic=tr&since=yesterday-ish", "trace-bad-time", status=400)
    assert "bad since 'yesterday-ish'" in text(page, "#search-error")


def test_single_nsqd_and_classic_lookupd(env, page):
    classic, base = env["classic"], env["single"].url
    node = classic.nsqd.http_address
    assert post_nsqd(node, "/topic/create?topic=solo&partition_num=2") == 200
    assert post_nsqd(node, "/channel/create?topic=solo&channel=c") == 200
    assert publish(node, "/pub?topic=solo", b"x") == 200
    until(lambda: Client(base).get("/api/topics/solo/c")[0] == 200, 10,
          "nsqadmin sees the topic and its channel")

    visit(env, page, base, "/cluster", "single-cluster")
    assert "no nsqlookupd" in text(page, "main")
    assert text(page, "#load-note").startswith("load reports not available")
    visit(env, page, base, "/topics/solo", "single-topic")
    assert "no ISR, catch-up or epoch" in text(page, "#replication-note")
    assert page.locator("table.partitions tbody tr").count() == 2
    visit(env, page, base, "/topics/solo/c", "single-channel")
    click(page, "pause")
    assert text(page, "#paused") == "yes"
    visit(env, page, base, f"/nodes/{node}", "single-node")
    assert "need an nsqlookupd" in text(page, "#tombstone-note")

    base = env["classic_admin"].url
    until(lambda: "solo" in Client(base).get(f"/api/nodes/{node}")[1].get("topics", []), 10,
          "the classic lookupd knows the topic")
    visit(env, page, base, f"/nodes/{node}", "classic-node")
    row = page.locator("table.node-topics tr", has_text="solo")
    row.locator("button", has_text="tombstone").click()
    page.wait_for_load_state()
    assert page.locator("table.node-topics tr", has_text="solo").locator(
        ".tag", has_text="tombstoned").count() == 1


def test_login_for_actions(env, page):
    node, base = env["classic"].nsqd.http_address, env["guarded"].url
    assert post_nsqd(node, "/topic/create?topic=guarded") == 200
    assert post_nsqd(node, "/channel/create?topic=guarded&channel=c") == 200
    until(lambda: Client(base).get("/api/topics/guarded/c")[0] == 200, 10, "nsqadmin sees it")
    visit(env, page, base, "/topics/guarded/c", "guarded-channel")  # reads are open
    click(page, "pause")  # refused: to the login page, then back
    assert "/login?next=" in page.url and page.locator("form.login").count() == 1
    page.screenshot(path=os.path.join(env["shots"], "login.png"), full_page=True)
    assert Client(base).get("/api/topics/guarded/c")[1]["paused"] is False
    page.fill("input[name=user]", "ops")
    page.fill("input[name=password]", "wrong")
    page.locator("form.login button").click()
    assert text(page, "#login-error") == "wrong user or password"
    page.fill("input[name=user]", "ops")
    page.fill("input[name=password]", PASSWORD)
    page.locator("form.login button").click()
    page.wait_for_load_state()
    assert page.url.endswith("/topics/guarded/c") and text(page, "nav .user") == "ops"
    click(page, "pause")
    assert text(page, "#paused") == "yes"
    click(page, "log out", within="nav")
    assert page.locator("nav a", has_text="log in").count() == 1


def no_overflow(pg, selector: str) -> bool:
    """True when every `selector` element shows its whole content without scrolling."""
    return pg.evaluate(f"[...document.querySelectorAll({selector!r})].every("
                       "e => e.scrollWidth <= e.clientWidth + 1)")


def test_what_a_new_user_sees_first_at_1280(env, page):
    """Issue 29: the front page leads with the topics (depth, rate); at 1280 px (and 1400)
    the partitions table fits without a horizontal scroll bar, the page body never
    overflows, the replay input shows its whole placeholder; the icon is served; a trace
    search on a topic with tracing off says so and offers the switch."""
    c, base = env["cluster"], env["admin"].url
    api = Client(base)
    assert api.post("/api/topics", {"topic": "first", "partitions": 3, "replicas": 3})[0] == 200
    assert api.post("/api/topics/first/channel_create", {"channel": "look"})[0] == 200
    until(lambda: all(len(p["isr"]) == 3 for p in api.get("/api/topics/first")[1]["partitions"])
          and len(api.get("/api/topics/first")[1]["partitions"]) == 3, 15, "three ISRs of 3")
    leader = c.nsqd_at(c.leaders("first")[0])
    assert publish(leader.http_address, "/pub?topic=first&partition=0", b"one") == 200
    until(lambda: api.get("/api/topics/first")[1]["messages"] == 1, 10, "1 message")

    visit(env, page, base, "/", "front")
    assert text(page, "main h1") == "Topics"
    row = page.locator("table.topics tr", has_text="first")
    assert row.is_visible() and row.locator("td").nth(3).inner_text() == "1"  # messages
    assert [h.inner_text() for h in page.locator("table.topics th").all()][4:6] == \
        ["depth", "msgs/s"]
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280

    visit(env, page, base, "/topics/first", "topic-1280")
    assert "3 partitions · 1 message · depth" in text(page, "main")
    assert page.locator("table.partitions select[name=to]").first.is_visible()
    assert no_overflow(page, "table.partitions") and no_overflow(page, "div.scroll")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.set_viewport_size({"width": 1400, "height": 900})
    assert no_overflow(page, "div.scroll")
    page.set_viewport_size({"width": 1280, "height": 900})

    visit(env, page, base, "/topics/first/look", "channel-1280")
    fits = page.evaluate("""() => { const e = document.querySelector('input[name=time]');
        const s = getComputedStyle(e), g = document.createElement('canvas').getContext('2d');
        g.font = s.font; return g.measureText(e.placeholder).width
            <= e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight); }""")
    assert fits, "the replay input cuts its placeholder"
    assert no_overflow(page, "div.scroll")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280

    assert page.request.get(base + "/favicon.ico").status == 200

    page.goto(base + "/trace")
    page.fill("input[name=topic]", "first")
    page.fill("input[name=since]", "-5m")
    page.locator("form.search button").click()
    page.wait_for_load_state()
    page.screenshot(path=os.path.join(env["shots"], "trace-tracing-off.png"), full_page=True)
    assert text(page, "#search-count").startswith("0 events, 0 messages")
    hint = page.locator("#tracing-off")
    assert hint.is_visible() and "tracing is off for topic first" in hint.inner_text()
    hint.locator("button", has_text="tracing on").click()
    page.wait_for_load_state()
    assert page.url.endswith("/topics/first") and page.locator("h1 .tag.traced").count() == 1
