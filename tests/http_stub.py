"""A local HTTP server that answers every GET (and HEAD) with what `respond(headers)` returns: a
stand-in for a tracking server (the tests of the MLflow preflight) or the Hugging Face hub (the
tests of the base model's preflight)."""

import http.server
import threading
from collections.abc import Callable


def serve(respond: Callable[[object], tuple]):
    """(server, its http:// uri); `respond(request headers) -> (status, body, content type)`, or with
    a fourth item, a dict of more response headers."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.answer(with_body=True)

        def do_HEAD(self):  # noqa: N802 (http.server's name)
            self.answer(with_body=False)

        def answer(self, with_body: bool):
            status, body, content_type, *more = respond(self.headers)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (more[0] if more else {}).items():
                self.send_header(name, value)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
