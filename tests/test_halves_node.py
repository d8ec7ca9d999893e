"""Half messages on an in-process node over HTTP, with a real check-back server (aiohttp)
for the producer's side: a committed half is delivered, a rolled back one never, an
undecided one is checked back and decided by the answer."""

from __future__ import annotations


from aiohttp import web

from test_deadletters import Consumer, _at, _channel, _json
from test_http import call


async def _check_server(decisions: dict):
    """A producer's check-back endpoint: answers each id from `decisions` (None: no
    decision); records what it was asked."""
    asked = []

    async def check(request):
        payload = await request.json()
        asked.append(payload)
        return web.json_response({"decision": decisions.get(payload["id"])})
    app = web.Application()
    app.router.add_post("/check", check)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/check", asked


async def test_commit_rollback_and_a_check_back(node):
    n = await node(half_check_timeout_ms=300)
    await _channel(n, "t", "ch")
    decisions: dict = {}
    runner, url, asked = await _check_server(decisions)
    try:
        ids = {}
        for body in (b"committed", b"rolled back", b"checked"):
            r = await call(_at(n), "POST", f"/half?topic=t&check_url={url}", body)
            assert r.status == 200, r.body
            ids[body] = r.json["id"]
        decisions[ids[b"checked"]] = "commit"
        con = await Consumer.open(n, "t", "ch")
        await con.nothing(0.2)  # halves are delivered by no channel
        assert await _json(n, "POST", f"/half/commit?topic=t&id={ids[b'committed']}") == {
            "state": "committed"}
        assert await _json(n, "POST", f"/half/commit?topic=t&id={ids[b'committed']}") == {
            "state": "committed"}  # sent again: the same answer, nothing written twice
        r = await call(_at(n), "POST", f"/half/rollback?topic=t&id={ids[b'committed']}")
        assert (r.status, r.json["message"]) == (409, "HALF_DECIDED")
        assert await _json(n, "POST", f"/half/rollback?topic=t&id={ids[b'rolled back']}") == {
            "state": "rolled_back"}
        got = []
        for _ in range(2):
            [(attempts, msg_id, body)] = await con.take()
            got.append(body)
            con.send(b"FIN " + msg_id + b"\n")
        assert got == [b"committed", b"checked"]  # the undecided one after its check-back
        await con.nothing(0.5)
        assert [a["id"] for a in asked] == [ids[b"checked"]]
        listed = await _json(n, "GET", "/half?topic=t")
        [p] = listed["partitions"]
        assert (p["waiting"], p["committed"], p["rolled_back"], p["checks"]) == ([], 2, 1, 1)
        [sp] = (await _json(n, "GET", "/stats?format=json&topic=t"))["topics"][0]["partitions"]
        assert {k: v for k, v in sp.items() if k.startswith("half_")} == {
            "half_waiting": 0, "half_committed": 2, "half_rolled_back": 1, "half_checks": 1,
            "half_expired": 0}
        r = await call(_at(n), "GET", "/metrics")
        text = r.body.decode()
        assert 'nsqd_partition_half_decided_total{topic="t",partition="0",decision="committed"} 2' \
            in text, text[:2000]
        assert 'nsqd_partition_half_checks_total{topic="t",partition="0"} 1' in text
        con.close()
    finally:
        await runner.cleanup()


async def test_half_commit_and_rollback_over_tcp(node):
    from nodes import connect
    from nsqclient.conn import NSQError
    from nsqwire.commands import encode_command

    n = await node()
    await _channel(n, "t", "ch")
    pub = await connect(n)
    url = "http://127.0.0.1:9/never"  # nobody answers: only the producer's decisions count
    ids = []
    for body in (b"a", b"b"):
        answer = await pub.command(encode_command(b"HALF", "t", 0, url, body=body))
        assert answer.startswith(b"OK ") and len(answer) == 19, answer
        ids.append(answer[3:])
    await pub.command(encode_command(b"COMMIT", "t", ids[0]))
    await pub.command(encode_command(b"COMMIT", "t", ids[0]))  # again: OK
    await pub.command(encode_command(b"ROLLBACK", "t", ids[1]))
    for command, msg_id, code in ((b"ROLLBACK", ids[0], "E_HALF_DECIDED"),
                                  (b"COMMIT", b"00000000000000ff", "E_HALF_NOT_FOUND")):
        try:
            await pub.command(encode_command(command, "t", msg_id))
            raise AssertionError(f"{command} {msg_id} was taken")
        except NSQError as e:
            assert str(e).startswith(code), e
    await pub.command(encode_command(b"COMMIT", "t", ids[0]))  # non-fatal: it goes on
    con = await Consumer.open(n, "t", "ch")
    [(_, _, body)] = await con.take()
    assert body == b"a"
    await con.nothing()
    con.close()


async def test_a_channel_state_names_the_first_undecided_half_for_the_replicas(node):
    """Replicas keep the log from a checkpoint's `halves_from` (replication.channels_received):
    it is there while a half waits, gone once none does."""
    n = await node()
    await _channel(n, "t", "ch")
    part = n.topics["t"].partitions[0]
    assert "halves_from" not in part.channels["ch"].checkpoint()
    ids = []
    for body in (b"a", b"b"):
        r = await call(_at(n), "POST", "/half?topic=t&check_url=http://127.0.0.1:9/c", body)
        ids.append(r.json["id"])
    first = part.halves.table.by_id[int(ids[0], 16)].offset
    assert part.channels["ch"].checkpoint()["halves_from"] == first
    assert part.retention_floor() <= first
    await _json(n, "POST", f"/half/rollback?topic=t&id={ids[0]}")
    second = part.halves.table.by_id[int(ids[1], 16)].offset
    assert part.channels["ch"].checkpoint()["halves_from"] == second
    await _json(n, "POST", f"/half/commit?topic=t&id={ids[1]}")
    assert "halves_from" not in part.channels["ch"].checkpoint()


async def test_bad_half_requests_get_4xx_or_e_invalid_and_change_nothing(node):
    from nodes import connect
    from nsqclient.conn import NSQError
    from nsqwire.commands import cmd_pub_ext, encode_command

    n = await node()
    await _channel(n, "t", "ch")
    for path, status, message in (
            ("/half?topic=t", 400, "MISSING_ARG_CHECK_URL"),
            ("/half?topic=t&check_url=ftp://x/", 400, "INVALID_CHECK_URL"),
            ("/half?topic=t&check_url=http://x/" + "a" * 1100, 400, "INVALID_CHECK_URL"),
            ("/half?topic=bad!name&check_url=http://x/", 400, "INVALID_TOPIC"),
            ("/half/commit?topic=nope&id=0000000000000000", 404, "TOPIC_NOT_FOUND"),
            ("/half?topic=t&partition=7&check_url=http://x/", 400, "BAD_PARTITION"),
            ("/half/commit?topic=t&id=xyz", 400, "INVALID_ID"),
            ("/half/commit?topic=t&id=00000000000000ff", 404, "HALF_NOT_FOUND"),
            ("/half/rollback?topic=t&id=%016x" % (5 << 50), 404, "PARTITION_NOT_HERE")):
        r = await call(_at(n), "POST", path, b"body")
        assert (r.status, r.json["message"]) == (status, message), (path, r.status, r.body)
    for command, code in (
            (encode_command(b"HALF", "t", 0, "gopher://x/", body=b"b"), "E_INVALID"),
            (encode_command(b"HALF", "t", 3, "http://x/", body=b"b"), "E_FAILED_ON_NOT_LEADER"),
            (cmd_pub_ext("t", {"##half": {"commit": 0}}, b"forged"), "E_INVALID"),
            (encode_command(b"COMMIT", "t", b"zz"), "E_INVALID")):
        conn = await connect(n)  # one each: E_INVALID closes the connection
        try:
            await conn.command(command)
            raise AssertionError(f"{command[:30]!r} was taken")
        except NSQError as e:
            assert str(e).startswith(code), (command[:30], e)
        finally:
            await conn.close()
    con = await Consumer.open(n, "t", "ch")
    await con.nothing(0.3)
    con.close()
    [p] = (await _json(n, "GET", "/half?topic=t"))["partitions"]
    assert (p["waiting"], p["committed"], p["rolled_back"]) == ([], 0, 0)
