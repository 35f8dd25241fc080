"""The policy versions a verifier holds in memory: at most `verifier.residentVersions` models, whatever the async
window (a 7B model is 15 GB in bf16; four of them and a copy were more than an 80 GB GPU holds).

`get(version)` answers from memory, or fetches the version and brings it in. When the bound is reached, the
least recently used version that no thread is using makes room: the new version's weights are loaded into its
model in place when the two differ in their weights only (`version_signature`), so memory never holds one model
more than the bound, and nothing is copied. A model is built from scratch (or copied from a resident one of the
same signature, which is faster) only while fewer than the bound are held, or when the signatures differ (a
LoRA run's merged adapters, a changed tokenizer).

Leases. The gate's loop and its HTTP API (another thread) both prefill, and loading in place must never touch a
model another thread is using. Each thread holds at most one lease, on the version `get` last gave it: `get`
moves the caller's lease to the version it asks for, `release` drops it (the API after each request, the loop
after each batch). A version leased by another thread is never made room from; a `get` that finds every
resident version leased by others waits for a release. A waiting thread holds no lease, so two threads never
wait for each other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.models.adapter import version_signature
from rlfleet.models.policy import load_weights_in_place
from rlfleet.versions.adapter import is_adapter_dir


@dataclass(frozen=True)
class Resident:
    model: Any
    tokenizer: Any
    signature: str | None  # version_signature; None for a model that is never loaded into (a merged adapter)


# fetch(version) -> its directory; build(directory, like) -> (model, tokenizer), `like` a resident one of the same
# signature to copy, or None; loaded(model) for every model built; kept(versions) after each version brought in.
Fetch = Callable[[int], Path]
Build = Callable[[Path, Resident | None], tuple[Any, Any]]


class ResidentVersions:
    """At most `capacity` policy versions in memory (module docstring)."""

    def __init__(
        self,
        capacity: int,
        fetch: Fetch,
        build: Build,
        built: Callable[[Any], None] = lambda model: None,
        kept: Callable[[list[int]], None] = lambda versions: None,
    ):
        self.capacity = capacity
        self._fetch, self._build, self._built, self._kept = fetch, build, built, kept
        self._models: OrderedDict[int, Resident] = OrderedDict()  # least recently used first
        self._leases: dict[int, int] = {}  # thread ident -> the version that thread is using
        self._signatures: dict[int, str | None] = {}  # version -> its signature, once read (versions are immutable)
        self._changed = threading.Condition()  # a lease released, or a version brought in
        self.last_used: tuple[Any, Any] | None = None  # (model, tokenizer) of the newest get: what /healthz probes
        self.loaded_in_place = 0  # versions brought in by loading into a resident model

    def versions(self) -> list[int]:
        """The resident versions, least recently used first."""
        with self._changed:
            return list(self._models)

    def get(self, version: int) -> tuple[Any, Any]:
        """(model, tokenizer) of `version`, leased to the calling thread until its next `get` or `release`."""
        me = threading.get_ident()
        with self._changed:
            if self._leases.pop(me, None) is not None:
                self._changed.notify_all()
            while version not in self._models and len(self._models) >= self.capacity and self._spare() is None:
                self._changed.wait()
            if version not in self._models:
                self._bring(version)
            self._leases[me] = version
            self._models.move_to_end(version)
            resident = self._models[version]
            self.last_used = (resident.model, resident.tokenizer)
            return self.last_used

    def describe(self, version: int) -> tuple[Any, Any]:
        """(model, tokenizer) whose config and tokenizer are `version`'s, for checks that read no weight (the
        prompt, the vocabulary, where a completion stops): `version`'s own when resident, else a resident one
        of the same signature, whose weights are another version's. Only when none matches is `version`
        brought in (`get`). Changes no lease: what it returns may be loaded into meanwhile, its config not."""
        with self._changed:
            if version in self._models:
                resident = self._models[version]
                return resident.model, resident.tokenizer
            signature = self._signature(version, self._fetch(version))
            alike = self._alike(signature)
            if alike is not None:
                return alike.model, alike.tokenizer
        return self.get(version)

    def release(self) -> None:
        """The calling thread no longer uses the version it last got."""
        with self._changed:
            if self._leases.pop(threading.get_ident(), None) is not None:
                self._changed.notify_all()

    def _spare(self) -> int | None:
        """The least recently used resident version no thread is using."""
        leased = set(self._leases.values())
        return next((v for v in self._models if v not in leased), None)

    def _alike(self, signature: str | None) -> Resident | None:
        """The most recently used resident version with this signature (None for None: an adapter)."""
        if signature is None:
            return None
        return next((r for r in reversed(self._models.values()) if r.signature == signature), None)

    def _signature(self, version: int, path: Path) -> str | None:
        """`version`'s version_signature (None: an adapter), read once."""
        if version not in self._signatures:
            self._signatures[version] = None if is_adapter_dir(path) else version_signature(path)
        return self._signatures[version]

    def _bring(self, version: int) -> None:
        path = self._fetch(version)
        signature = self._signature(version, path)
        if len(self._models) >= self.capacity:
            spare = self._spare()
            assert spare is not None  # get waited for one
            old = self._models.pop(spare)
            if signature is not None and old.signature == signature:
                try:
                    load_weights_in_place(old.model, path)
                except ValueError:  # checked before any weight was written: the old version is intact
                    self._models[spare] = old
                    self._models.move_to_end(spare, last=False)
                    raise
                self._models[version] = Resident(old.model, old.tokenizer, signature)
                self.loaded_in_place += 1
                self._kept(list(self._models))
                return
            if self.last_used is not None and self.last_used[0] is old.model:
                self.last_used = None
            del old  # its memory goes before the new model is built
        model, tokenizer = self._build(path, self._alike(signature))
        self._built(model)
        self._models[version] = Resident(model, tokenizer, signature)
        self._kept(list(self._models))
