"""MediaTypeProxy: lets the official elasticsearch-py 9 client talk to osmem-server (an
OpenSearch-API server) in tests. No Elasticsearch server installs here.

It forwards every request and answer unchanged except for two headers, the only
differences between the two APIs that the client trips on:
- requests: the client's `application/vnd.elasticsearch+json; compatible-with=9` (and the
  x-ndjson form of bulk) become plain `application/json` / `application/x-ndjson`
  (OpenSearch-API servers answer the versioned media types with 406);
- answers: `X-Elastic-Product: Elasticsearch` is set (the client refuses an answer
  without it: UnsupportedProductError; osmem-server already sends it, a real OpenSearch
  does not).
While osmem-server is down the proxy answers 502, as a reverse proxy in front of a dead
Elasticsearch does. With `tls=(certfile, keyfile)` it serves https (the test of
--trace-es-ca-certs), and it keeps every Authorization header it was sent
(`authorizations`: the test of the credentials; osmem-server itself checks none). With
`bulk_answers` cleared it holds back the answers of bulk writes the server made (the test
of a store process killed while it waited for one). It is a thread in the test process,
not a server of its own: every document, mapping and search is osmem-server's.
"""

from __future__ import annotations

import http.client
import http.server
import re
import ssl
import threading

_VENDOR = re.compile(r"application/vnd\.elasticsearch\+(json|x-ndjson)\s*;\s*compatible-with=\d+")


def plain_media_type(value: str) -> str:
    return _VENDOR.sub(lambda m: f"application/{m.group(1)}", value)


class MediaTypeProxy:
    def __init__(self, upstream: str, tls: tuple[str, str] | None = None):
        self.upstream = upstream  # host:port of osmem-server
        self.authorizations: list[str] = []
        self.bulk_answers = threading.Event()  # cleared: a _bulk's answer is held back
        self.bulk_answers.set()
        self.bulk_held = threading.Event()  # set once a _bulk reached the server unanswered
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                if "Authorization" in self.headers:
                    proxy.authorizations.append(self.headers["Authorization"])
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: plain_media_type(v) if k.lower() in ("content-type", "accept") else v
                           for k, v in self.headers.items() if k.lower() != "host"}
                host, port = proxy.upstream.rsplit(":", 1)
                try:
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    status, answer, rheaders = resp.status, resp.read(), resp.getheaders()
                    conn.close()
                except OSError:
                    status, answer, rheaders = 502, b'{"error":"upstream down"}', [
                        ("Content-Type", "application/json")]
                if "_bulk" in self.path and not proxy.bulk_answers.is_set():
                    proxy.bulk_held.set()  # the server wrote it; the client waits on
                    proxy.bulk_answers.wait(30)
                self.send_response(status)
                skip = ("content-length", "transfer-encoding", "connection", "x-elastic-product")
                for k, v in rheaders:
                    if k.lower() not in skip:
                        self.send_header(k, v)
                self.send_header("X-Elastic-Product", "Elasticsearch")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(answer)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "MediaTypeProxy":
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
