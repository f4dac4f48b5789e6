"""The listening sockets of the HTTP front ends (``serve --api-workers N``), and the response header that names the
front end that answered.

On Linux each worker gets a socket of its own, all bound to the same ``host:port`` with ``SO_REUSEPORT``: the kernel
hashes each new connection (its addresses and ports) to one of the sockets, so a burst of connections spreads over
every worker. On one shared socket instead, whichever worker's accept loop wakes first drains the backlog, and a burst
can land mostly on one worker. Where ``SO_REUSEPORT`` is missing (or does not balance: it only does on Linux) the
workers share one socket, as before.

The sockets are bound here, in the supervisor, and not yet listening: a port in use fails at once, as a user error
naming ``host:port``, before any engine is built; each worker's server starts listening on its socket when it is ready
to accept (asyncio listens on the sockets it is given), and the supervisor closes its copies once the workers hold
theirs. A socket in the ``SO_REUSEPORT`` group that nobody accepts on would keep getting its share of connections, and
they would hang; closing the supervisor's copies means a worker that dies takes its socket out of the group.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mcore_infer.errors import InvalidRequestError

__all__ = ["WORKER_HEADER", "WorkerHeader", "bind_worker_sockets", "reuseport_balances"]

log = logging.getLogger(__name__)

WORKER_HEADER = "x-mcore-worker"
"""The response header that names the front-end worker (its index, from 0) that answered."""

BACKLOG = 2048


@functools.cache
def reuseport_balances() -> bool:
    """Whether this system spreads connections over sockets bound with ``SO_REUSEPORT`` (Linux)."""
    opt = getattr(socket, "SO_REUSEPORT", None)
    if opt is None or not sys.platform.startswith("linux"):
        return False
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, opt, 1)
    except OSError:  # a kernel without it (ENOPROTOOPT)
        return False
    return True


def _new_socket(host: str, reuseport: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.set_inheritable(True)
    return sock


def _bind(host: str, port: int, reuseport: bool) -> socket.socket:
    sock = _new_socket(host, reuseport)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def bind_worker_sockets(host: str, port: int, workers: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for ``workers`` front ends on ``host:port`` (port 0: one the system picks):
    one per worker sharing the address through ``SO_REUSEPORT`` where that balances (Linux, more than one worker),
    else one socket for all. A port in use raises :class:`InvalidRequestError` naming ``host:port``."""
    probe = _bind(host, port, reuseport=False)  # without SO_REUSEPORT: fails on any holder, another such group too
    if workers == 1 or not reuseport_balances():
        if workers > 1:
            log.info("SO_REUSEPORT is not available here: the %d front ends share one listening socket", workers)
        return [probe]
    port = probe.getsockname()[1]
    probe.close()
    socks: list[socket.socket] = []
    try:
        for _ in range(workers):
            socks.append(_bind(host, port, reuseport=True))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class WorkerHeader:
    """ASGI middleware: every HTTP response of ``app`` carries ``x-mcore-worker: <index>``, and ``served`` counts
    the HTTP requests this worker took (logged when it stops)."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app, self.index, self.served = app, index, 0
        self._value = str(index).encode()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:  # fmt: skip
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.served += 1

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (WORKER_HEADER.encode(), self._value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged)
