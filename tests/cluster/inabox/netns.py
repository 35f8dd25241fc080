"""Sockets in another network namespace from this process: what lets the test process (in the
machine's own namespace) serve the API emulator on a cluster's bridge, probe pods as a kubelet
does, and forward a local port to a pod as `kubectl port-forward` does.

setns(2) with CLONE_NEWNET moves only the calling thread; a socket keeps the namespace it was
made in for its whole life. So `socket_in(netns)` enters the namespace on the current thread,
makes the socket and returns to the thread's own namespace before anything else runs on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import socket
import ssl
import threading
from collections.abc import Iterator

from testbed.commands import NETNS_RUN

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """This thread in network namespace `netns` (a name under /run/netns) for the block."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_RUN / netns, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def socket_in(netns: str, family: int = socket.AF_INET, type_: int = socket.SOCK_STREAM) -> socket.socket:
    with entered(netns):
        return socket.socket(family, type_)


def connect(netns: str, host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to host:port made from inside `netns`."""
    sock = socket_in(netns)
    sock.settimeout(timeout)
    try:
        sock.connect((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen(netns: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port inside `netns`."""
    sock = socket_in(netns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


class _Connection(http.client.HTTPConnection):
    def __init__(self, netns: str, host: str, port: int, timeout: float, https: bool = False):
        super().__init__(host, port, timeout=timeout)
        self.netns, self.https = netns, https

    def connect(self) -> None:
        self.sock = connect(self.netns, self.host, self.port, self.timeout)
        if self.https:  # as the kubelet's HTTPS probes: TLS, the certificate not verified
            self.sock = ssl._create_unverified_context().wrap_socket(self.sock, server_hostname=self.host)


def http_get(netns: str, host: str, port: int, path: str, timeout: float, https: bool = False) -> tuple[int, bytes]:
    """(status, body) of GET http(s)://host:port/path from inside `netns`; OSError when it cannot connect."""
    conn = _Connection(netns, host, port, timeout, https)
    try:
        conn.request("GET", path, headers={"User-Agent": "kube-probe/inabox"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class PortForward:
    """127.0.0.1:`port` in this namespace forwarded to host:port inside `netns` (`kubectl port-forward`):
    one pair of pump threads per connection; `close()` stops accepting and closes every connection."""

    def __init__(self, netns: str, host: str, port: int):
        self.netns, self.target = netns, (host, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"port-forward-{host}:{port}").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = connect(self.netns, *self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            pair = _Pair(client, upstream, self._forget)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pair.pump, args=(a, b), daemon=True).start()

    def _forget(self, sockets: tuple[socket.socket, ...]) -> None:
        with self._lock:
            self._open -= set(sockets)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._open = self._open, set()
        self._server.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pair:
    """Both directions of one forwarded connection; the sockets close when both directions ended."""

    def __init__(self, a: socket.socket, b: socket.socket, forget):
        self.sockets, self.forget, self.running = (a, b), forget, 2
        self.lock = threading.Lock()

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:  # a reset: end the other direction too
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        with self.lock:
            self.running -= 1
            last = self.running == 0
        if last:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.close()
            self.forget(self.sockets)
