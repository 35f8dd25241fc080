"""One version being pulled by a relay, and the cut-through serving of it while it arrives.

A `Pull` is written by the relay's pull thread (client.Fetcher callbacks) and read on the event
loop. Per shard it knows how many bytes are on disk in the current attempt (`received`), which
attempt that is (`attempts`: a digest mismatch voids the bytes and starts the next one) and
whether the shard verified (`ready`).

`stream` serves a byte range of a file while the pull fills it: bytes go out (sendfile from the
partial file) as soon as they are on disk, a shard's before its sha256 is known. Invariants:
  - a response never ends before every shard it overlaps has verified: its last byte waits for
    that, so no downstream ever receives a complete response holding a shard that failed (and
    every downstream checks each shard against the signed manifest itself anyway);
  - a response that sent bytes of an attempt that then failed is cut off (the connection is
    aborted): the downstream sees a short body, which it treats as a broken transfer;
  - nothing is sent before the first byte is on disk, so a pull that fails before any byte
    still answers 502 (relay.py).
Waiting only for whole shards (as before) cost a relay's clients the time to pull `parallel`
shards at the start and at the end of every version: ~2.7 s of a 21 s broadcast on the WAN
benchmark's default topology with 16 MiB shards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import BinaryIO

from aiohttp import web

from rlfleet.services.shardcast.protocol import parse_range, start_response
from rlfleet.versions.manifest import FileEntry, Manifest, Shard

log = logging.getLogger("rlfleet.shardcast.relay")


class Pull:
    """One version being pulled: its verified manifest, then the shards' progress."""

    def __init__(self, version: int, loop: asyncio.AbstractEventLoop):
        self.version, self.loop = version, loop
        self.raw: bytes | None = None
        self.manifest: Manifest | None = None
        self.ready: set[tuple[int, int]] = set()  # (file index, shard index) verified
        self.received: dict[tuple[int, int], int] = {}  # bytes on disk of the current attempt
        self.attempts: dict[tuple[int, int], int] = {}
        self.complete = False
        self.error: BaseException | None = None
        self.size = 0
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Wake every waiter (from any thread)."""
        self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def progress(self, i: int, j: int, nbytes: int, attempt: int) -> None:
        """Fetcher callback (pull thread): bytes [0, nbytes) of shard (i, j) are on disk."""
        self.received[(i, j)], self.attempts[(i, j)] = nbytes, attempt
        self.notify()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        while True:
            changed = self._changed
            if predicate():
                return
            if self.error is not None:
                raise self.error
            await changed.wait()

    def _file(self, index: int) -> FileEntry:
        assert self.manifest is not None, "a pull's files are asked for only once its manifest is in"
        return self.manifest.files[index]

    def _shards(self, index: int) -> tuple[Shard, ...]:
        return self._file(index).shards

    def covers(self, index: int, start: int, end: int) -> bool:
        """All shards of file `index` overlapping bytes [start, end) are verified."""
        if self.complete:
            return True
        return all(
            (index, j) in self.ready
            for j, s in enumerate(self._shards(index))
            if s.offset < end and s.offset + s.size > start
        )

    def available(self, index: int, pos: int) -> int:
        """End of the bytes of file `index` on disk from `pos` on without a gap (verified or not)."""
        if self.complete:
            return self._file(index).size
        for j, s in enumerate(self._shards(index)):
            if s.offset + s.size <= pos:
                continue
            if (index, j) in self.ready:
                pos = s.offset + s.size
                continue
            return max(pos, s.offset + self.received.get((index, j), 0))
        return pos

    def shards_in(self, index: int, start: int, end: int) -> list[int]:
        return [j for j, s in enumerate(self._shards(index)) if s.offset < end and s.offset + s.size > start]


async def stream(
    request: web.Request, pull: Pull, index: int, size: int, open_file: Callable[[], BinaryIO], on_bytes=None
) -> web.StreamResponse:
    """Serve a Range of file `index` of `pull` while it arrives (see the module doc). Errors before
    the first byte propagate (the caller answers 502); after it, the connection is aborted and
    the cut-off logged."""
    status, start, end = parse_range(request, size)
    await pull.wait(lambda: pull.available(index, start) > start or pull.covers(index, start, end))
    loop = asyncio.get_running_loop()
    with open_file() as f:
        resp = await start_response(request, status, start, end, size, "application/octet-stream")
        pos, sent_from = start, dict[int, int]()  # shard -> attempt whose bytes went out before it verified

        def broken() -> bool:
            return any(pull.attempts.get((index, j), 0) != a for j, a in sent_from.items())

        def can_send() -> bool:  # the last byte only once every shard in the range verified
            return pull.covers(index, start, end) or min(pull.available(index, pos), end - 1) > pos or broken()

        try:
            while pos < end and request.method != "HEAD":
                await pull.wait(can_send)
                if broken():
                    raise ConnectionAbortedError("a shard failed its sha256 after its bytes went out")
                limit = end if pull.covers(index, start, end) else min(pull.available(index, pos), end - 1)
                for j in pull.shards_in(index, pos, limit):
                    if (index, j) not in pull.ready:
                        sent_from.setdefault(j, pull.attempts.get((index, j), 0))
                if request.transport is None:
                    raise ConnectionResetError("client went away")
                sent = await loop.sendfile(request.transport, f, pos, limit - pos)
                if on_bytes is not None:
                    on_bytes(sent)
                pos = limit
        except Exception as exc:  # after the headers: end the body short, quietly for aiohttp
            if request.transport is not None:
                request.transport.abort()  # the downstream sees a broken transfer and retries
            level = logging.DEBUG if isinstance(exc, ConnectionError) and not broken() else logging.WARNING
            log.log(level, "v%d %s: response cut off after %d of %d bytes: %s", pull.version, request.path,
                    pos - start, end - start, exc)  # fmt: skip
            return resp
    await resp.write_eof()
    return resp
