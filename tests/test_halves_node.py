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
