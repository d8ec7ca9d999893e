"""HTTP API (placeholder until the full API lands): /ping only."""

from aiohttp import web


async def start_http(nsqd):
    app = web.Application()
    app.router.add_get("/ping", lambda request: web.Response(text="OK"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = nsqd.options.http_host_port
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
