"""uvicorn's HTTP protocol with one change: a request that cannot be parsed as HTTP/1.1 (a bad ``Content-Length``,
a malformed request line or header) is answered with the OpenAI-style JSON error body instead of uvicorn's plain
text. Such requests never reach the app, so this is the only place to shape that answer.

It subclasses whichever protocol uvicorn's ``http="auto"`` would pick (httptools when installed, else h11) and
overrides ``send_400_response``, the one method both call for unparsable input, so serving speed is unchanged.
Imported only by :func:`mcore_infer.server.serve` (uvicorn is an optional dependency).
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from mcore_infer.protocol import error_body

__all__ = ["JSONErrorHTTPProtocol", "bad_request_bytes"]


def bad_request_bytes(msg: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole ``400 Bad Request`` HTTP/1.1 response carrying ``msg`` in an OpenAI error body; the connection
    closes after it (the request could not be framed, so nothing after it on the connection can be trusted)."""
    body = json.dumps(error_body(msg, "invalid_request_error", None, "invalid_http_request")).encode()
    head = [b"HTTP/1.1 400 Bad Request"]
    head += [name + b": " + value for name, value in default_headers]
    head += [b"content-type: application/json", b"content-length: " + str(len(body)).encode(), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class JSONErrorHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's protocol (``http="auto"``) whose answer to an unparsable request is a JSON error body."""

    server_state: Any
    transport: Any

    def send_400_response(self, msg: str) -> None:
        self.transport.write(bad_request_bytes(msg, self.server_state.default_headers))
        self.transport.close()
