"""AUTH's ttl, as classic nsqd: the auth server's answer holds for `ttl` seconds, then the
next PUB or SUB asks it again with the same secret and obeys the new answer."""

import asyncio
import json

import pytest
from aiohttp import web

from nodes import connect
from nsqclient.conn import NSQError


class ChangingAuthServer:
    """A real HTTP auth server on loopback whose grants the test changes."""

    def __init__(self, ttl: int):
        self.ttl = ttl
        self.permissions = ["publish", "subscribe"]
        self.calls = 0
        self.fail = False
        self.answer = None  # when set: the raw JSON answered instead of the grants

    async def start(self) -> str:
        async def auth(request):
            self.calls += 1
            if self.fail:
                return web.json_response({"message": "DOWN"}, status=500)
            if self.answer is not None:
                return web.Response(text=self.answer, content_type="application/json")
            return web.json_response({
                "ttl": self.ttl, "identity": "who", "identity_url": "",
                "authorizations": [{"topic": "t", "channels": [".*"],
                                    "permissions": self.permissions}]})

        app = web.Application()
        app.router.add_get("/auth", auth)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def auth_server():
    servers = []

    async def start(ttl):
        s = ChangingAuthServer(ttl)
        servers.append((s, await s.start()))
        return servers[-1]

    yield start
    for s, _ in servers:
        await s.runner.cleanup()


async def test_grants_are_asked_again_after_their_ttl(node, auth_server):
    server, address = await auth_server(ttl=1)
    n = await node(auth_http_address=[address])
    c = await connect(n)
    reply = json.loads(await c.command(b"AUTH\n" + len(b"s3cret").to_bytes(4, "big") + b"s3cret"))
    assert reply["identity"] == "who" and server.calls == 1
    await c.pub("t", b"granted")
    server.permissions = ["subscribe"]  # publishing is taken away
    await c.pub("t", b"still within the ttl")
    assert server.calls == 1
    await asyncio.sleep(1.1)
    with pytest.raises(NSQError, match="E_UNAUTHORIZED"):
        await c.pub("t", b"after the ttl")
    assert server.calls == 2


async def test_an_unreachable_auth_server_after_the_ttl_fails_the_command(node, auth_server):
    server, address = await auth_server(ttl=0)  # ttl 0: asked again before every check
    n = await node(auth_http_address=[address])
    c = await connect(n)
    await c.command(b"AUTH\n" + len(b"s3cret").to_bytes(4, "big") + b"s3cret")
    await c.pub("t", b"ok")
    assert server.calls == 2
    server.fail = True
    with pytest.raises(NSQError, match="E_AUTH_FAILED"):
        await c.pub("t", b"no answer")


MALFORMED_ANSWERS = [
    '{"ttl": 60, "authorizations": "everything"}',
    '{"ttl": 60, "authorizations": {"topic": "t"}}',
    '{"ttl": 60, "authorizations": ["t"]}',
    '{"ttl": 60, "authorizations": [{"topic": 7, "channels": [".*"], "permissions": ["publish"]}]}',
    '{"ttl": 60, "authorizations": [{"topic": "t", "channels": ".*", "permissions": ["publish"]}]}',
    '{"ttl": 60, "authorizations": [{"topic": "t", "channels": [".*"], "permissions": "publish"}]}',
    '{"ttl": "soon", "authorizations": [{"topic": "t", "channels": [], "permissions": []}]}',
    '{"ttl": 60, "identity": {"name": "x"}, "authorizations": []}',
    '[{"topic": "t"}]',
    '"granted"',
    'not json',
]


@pytest.mark.parametrize("answer", MALFORMED_ANSWERS)
async def test_a_malformed_auth_answer_is_a_failed_auth(node, auth_server, capfd, answer):
    """Classic nsqd decodes the answer into typed fields, and any mismatch fails AUTH: here
    too, with E_AUTH_FAILED and one log line, never `E_INVALID internal error` and a
    traceback. The connection then still works for a later, good answer."""
    server, address = await auth_server(ttl=60)
    server.answer = answer
    n = await node(auth_http_address=[address])
    c = await connect(n)
    with pytest.raises(NSQError, match="E_AUTH_FAILED"):
        await c.command(b"AUTH\n" + len(b"s3cret").to_bytes(4, "big") + b"s3cret")
    await c.close()
    out = capfd.readouterr()
    log = out.out + out.err
    assert "Traceback" not in log, log
    assert log.count("auth_server_failed") == 1, log


async def test_half_commands_need_the_publish_permission(node, auth_server):
    from nsqwire.commands import cmd_decide, cmd_half

    server, address = await auth_server(ttl=60)
    n = await node(auth_http_address=[address])
    c = await connect(n)
    with pytest.raises(NSQError, match="E_AUTH_FIRST"):
        await c.command(cmd_half("t", b"before AUTH", "http://127.0.0.1:9/"))
    c = await connect(n)  # E_AUTH_FIRST closed it
    await c.command(b"AUTH\n" + len(b"s3cret").to_bytes(4, "big") + b"s3cret")
    answer = await c.command(cmd_half("t", b"granted", "http://127.0.0.1:9/"))
    server.permissions = ["subscribe"]
    server.ttl = 0
    await asyncio.sleep(0.1)
    c2 = await connect(n)
    await c2.command(b"AUTH\n" + len(b"s3cret").to_bytes(4, "big") + b"s3cret")
    with pytest.raises(NSQError, match="E_UNAUTHORIZED"):
        await c2.command(cmd_decide("t", answer[3:].decode(), True))
    await c.command(cmd_decide("t", answer[3:].decode(), True))  # its grant still holds
