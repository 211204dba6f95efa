"""A local HTTP server that answers every GET with what `respond(headers)` returns: a stand-in for
a tracking server (the tests of the MLflow preflight)."""

import http.server
import threading
from collections.abc import Callable


def serve(respond: Callable[[object], tuple[int, bytes, str]]):
    """(server, its http:// uri); `respond(request headers) -> (status, body, content type)`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            status, body, content_type = respond(self.headers)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
