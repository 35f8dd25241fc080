"""Fetch a policy version as a loader sees it: downloaded whole, or rebuilt from a held version and deltas.

`fetch_policy(settings, N, dest_root)` is what rollout workers and the verifier call (client.fetch_version
downloads every file a manifest lists, which for a delta version are its patches; both take one
client.FetchSettings):
  1. dest_root/v{N}/.complete exists -> return it.
  2. Plan, walking back from N through signed manifests (signature first, then shape:
     client.Fetcher.manifest). Each version K offers one or two routes (versions.chain): its whole files
     (a whole version) and its delta against K-1. Candidates, each with its download size:
       whole(K) + deltas K+1..N        for every whole K on the walk
       deltas B+1..N                   when the walk reaches a base B held here complete, with the very
                                       bytes the delta was made against (`base_sha256` = B's manifest entry)
     The walk stops at a held base, at a version with no delta, once the deltas alone cost more
     than the cheapest candidate so far, or, past a whole version, at a version no source keeps any
     more (404 everywhere: retention pruned it); the cheapest candidate is the plan. So a worker holding N-1
     downloads N's delta, one that is new or far behind a whole version and the deltas after it, or
     a whole N when that is smaller. A held base whose recorded bytes differ (another lineage) is
     discarded on the way.
  3. Build oldest first, each version in `.v{K}.partial/` (journaled, resumable), then `.complete`,
     then renamed to v{K}. Whole route: the whole files' shards. Delta route: the patch files' shards,
     then every resulting file (patch applied to the base's file, the base's file copied, or the file
     shipped whole) is written and hashed, and its size and sha256 must equal the signed manifest's
     before `.complete` is written: a rebuilt version is as verified as a downloaded one.
  4. A delta that fails to rebuild (DeltaError: the held base's bytes are not what its manifest says,
     or the patch does not decode to the signed result) discards that base and plans again, which
     now ends at a whole version; a second failure raises FetchError. An older version of the chain
     that every source dropped while it was built (VersionGone, 410) plans again too; N itself gone
     raises VersionGone (client.py): the caller fetches a newer version.
Intermediate versions of a chain are installed too (each verified); the caller prunes its cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from prometheus_client import Counter

from rlfleet.services.shardcast.client import Fetcher, FetchError, FetchSettings, VersionGone
from rlfleet.services.shardcast.staging import JOURNAL, ShardJournal, install
from rlfleet.versions.chain import (
    DeltaError,
    base_of,
    delta_files,
    result_files,
    section_of,
    size_of,
    whole,
    whole_files,
)
from rlfleet.versions.checkpoint import version_dir_name
from rlfleet.versions.codec import apply_file
from rlfleet.versions.manifest import COMPLETE_MARKER, MANIFEST_NAME, FileEntry, Manifest

log = logging.getLogger("rlfleet.shardcast.client")

__all__ = ["DELTAS", "fetch_policy"]

DELTAS = Counter("rlfleet_client_delta_versions", "Delta versions this process handled", ["result"])
# Both results are exported from the start (at 0): a run whose workers fetched only whole versions still has the
# series, so its dashboard panel shows "none rebuilt" rather than no data.
for _result in ("rebuilt", "rejected"):
    DELTAS.labels(_result)
REBUILT = ".rebuilt"  # inside a partial dir: resulting files while they are being written and checked


def fetch_policy(settings: FetchSettings, version: int, dest_root: Path, report: dict | None = None) -> Path:
    """Make dest_root/v{N} hold `settings.run` v`version` as loaded (whole files), verified, within
    settings.timeout; return it. `report`, if given, is filled with the plan: `chain` (versions built,
    oldest first), `kinds` ("full"/"delta" each), `bytes` (transfer bytes of the chain) and
    `rejected` (why a delta or a held base was refused, one line each)."""
    dest_root = Path(dest_root)
    final = dest_root / version_dir_name(version)
    report = {} if report is None else report
    report.update(chain=[], kinds=[], bytes=0, rejected=[])
    if (final / COMPLETE_MARKER).exists():
        return final
    dest_root.mkdir(parents=True, exist_ok=True)
    job = _Job(settings, dest_root, report)
    for attempt in (1, 2):
        plan = job.plan(version)
        report.update(chain=[v for v, *_ in plan], kinds=[route for *_, route in plan])
        report["bytes"] = sum(size_of(_route_files(m, route)) for _, _, m, route in plan)
        try:
            for v, raw, manifest, route in plan:
                job.build(v, raw, manifest, route)
            return final
        except VersionGone as exc:
            if exc.version == version or attempt == 2:
                raise
            # an older version of the chain was dropped between planning and building: the walk now ends at it
            log.info("run %r v%d went while v%d was built from it; planning again", settings.run, exc.version, version)
        except DeltaError as exc:
            DELTAS.labels("rejected").inc()
            report["rejected"].append(str(exc))
            if attempt == 2:
                raise FetchError(
                    f"run {settings.run!r} v{version}: rebuilding from a whole version failed too: {exc}"
                ) from exc
            log.warning("%s; discarding the base and starting again from a whole version", exc)
            job.discard(exc.base)
    raise AssertionError("unreachable")


class _Job:
    """One fetch_policy call: its settings, deadline (settings.timeout from now), destination and report."""

    def __init__(self, settings: FetchSettings, dest_root: Path, report: dict):
        self.settings, self.run, self.dest_root, self.report = settings, settings.run, dest_root, report
        self.deadline = time.monotonic() + settings.timeout

    def fetcher(self, version: int) -> Fetcher:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FetchError(f"run {self.run!r} v{version}: out of time while fetching a delta chain")
        return Fetcher(self.settings, version, left)

    def held(self, version: int) -> Path | None:
        path = self.dest_root / version_dir_name(version)
        return path if (path / COMPLETE_MARKER).exists() else None

    def discard(self, version: int | None) -> None:
        path = self.held(version) if version is not None else None
        if path is not None:
            trash = path.with_name(f".{path.name}.discarded-{time.monotonic_ns()}")
            path.rename(trash)  # not held from here on, then deleted
            shutil.rmtree(trash, ignore_errors=True)

    def manifest(self, version: int, missing_ok: bool = False) -> tuple[bytes, Manifest] | None:
        fetcher = self.fetcher(version)
        try:
            return fetcher.manifest(missing_ok)
        finally:
            fetcher.close()

    def plan(self, version: int) -> list[tuple[int, bytes, Manifest, str]]:
        """(version, raw manifest, manifest, "full" or "delta") to build, oldest first (step 2 of the module
        docstring)."""
        walked, best, deltas, v = [], None, 0, version  # best: (bytes, index into walked, route there)
        while True:
            # Past a whole version the walk only looks for something cheaper: a version no source
            # keeps any more (pruned by retention) ends it there.
            got = self.manifest(v, missing_ok=best is not None)
            if got is None:
                log.info("run %r v%d is no longer kept; building from the cheapest route found", self.run, v)
                break
            raw, manifest = got
            walked.append((v, raw, manifest))
            if whole(manifest) and (best is None or deltas + size_of(whole_files(manifest)) < best[0]):
                best = (deltas + size_of(whole_files(manifest)), len(walked) - 1, "full")
            base = base_of(manifest)
            if base is None:
                break
            deltas += size_of(delta_files(manifest))
            held = self.held(base)
            if held is not None:
                problem = _base_mismatch(held, manifest)
                if problem is None:
                    if best is None or deltas < best[0]:
                        best = (deltas, len(walked) - 1, "delta")
                    break
                self.report["rejected"].append(problem)
                log.warning("%s; discarding it", problem)
                self.discard(base)
            if best is not None and deltas >= best[0]:
                break
            v = base
        if best is None:  # neither whole nor naming a base: nothing to build from
            raise DeltaError(f"run {self.run!r} v{version}: no whole version or held base to build it from")
        _, start, route = best
        return [(*walked[start], route)] + [(*walked[i], "delta") for i in range(start - 1, -1, -1)]

    def build(self, version: int, raw: bytes, manifest: Manifest, route: str) -> None:
        """Download `version`'s files for `route` and, for a delta, rebuild its resulting files; install it verified."""
        final = self.dest_root / version_dir_name(version)
        if (final / COMPLETE_MARKER).exists():
            return
        partial = self.dest_root / f".{final.name}.partial"
        files = _route_files(manifest, route)  # what this route downloads
        fetcher = self.fetcher(version)
        try:
            with ShardJournal(partial) as journal:
                done = journal.resume(raw, files)
                fetcher.shards(files, partial, done, journal.record)
            (partial / JOURNAL).unlink()
            if route == "delta":
                base = base_of(manifest)
                assert base is not None  # plan() routes "delta" only to a manifest naming its base
                held = self.held(base)
                if held is None:
                    raise DeltaError(f"run {self.run!r} v{version}: its base v{base} is not held here")
                rebuild(partial, held, manifest, version, base)
                DELTAS.labels("rebuilt").inc()
            _tidy(partial, {e.name for e in result_files(manifest)})
            (partial / COMPLETE_MARKER).write_text(f"{len(raw)} bytes of manifest, every file verified\n")
            install(partial, final)
        except DeltaError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:  # out of time or stopped, the partial dir stays: the next try resumes from its journal
            self.deadline = max(self.deadline, fetcher.deadline)  # the chain's next version gets what this one got
            fetcher.close()


def _route_files(manifest: Manifest, route: str) -> list[FileEntry]:
    return whole_files(manifest) if route == "full" else delta_files(manifest)


def _tidy(partial: Path, keep: set[str]) -> None:
    """Remove from `partial` every file that is not one of the version's (a patch, or a file an earlier,
    interrupted attempt by the other route left) but its manifest."""
    for path in sorted(partial.rglob("*"), reverse=True):
        name = path.relative_to(partial).as_posix()
        if path.is_file() and name not in keep and name != MANIFEST_NAME:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _base_mismatch(held: Path, manifest: Manifest) -> str | None:
    """Why the held base cannot be the base of `manifest` (its recorded files differ), or None. The held
    manifest was verified when it was fetched; reading it back from this disk checks its shape again."""
    try:
        recorded_manifest = Manifest.from_json(json.loads((held / MANIFEST_NAME).read_bytes()))
    except (OSError, ValueError) as exc:
        return f"held {held.name} has no readable manifest ({exc})"
    recorded = {e.name: e.sha256 for e in result_files(recorded_manifest)}
    for entry in section_of(manifest).files:
        if entry.source != "file" and recorded.get(entry.name) != entry.base_sha256:
            assert entry.base_sha256 is not None  # check_manifest: a "patch" or "base" entry names its base's sha256
            return (
                f"v{manifest.version} was made against {entry.name} with sha256 {entry.base_sha256[:12]}..., "
                f"the held {held.name} has {str(recorded.get(entry.name))[:12]}... (wrong base)"
            )
    return None


def _copy_hashed(src: Path, dest: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as f, open(dest, "wb") as out:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def rebuild(partial: Path, base_dir: Path, manifest: Manifest, version: int, base: int) -> None:
    """Turn `partial` (the verified transfer files of a delta version) into the resulting files, each
    checked against the signed manifest; raise DeltaError (naming `base`) when the base does not fit."""
    problem = _base_mismatch(base_dir, manifest)
    if problem is not None:
        raise DeltaError(problem, base=base)
    work = partial / REBUILT
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    section = section_of(manifest).files
    for entry in section:
        name, out = entry.name, work / entry.name
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            if entry.source == "patch":
                assert entry.patch is not None  # check_manifest: a "patch" entry names its patch file
                got = apply_file(base_dir / name, partial / entry.patch, out)
            elif entry.source == "base":
                got = _copy_hashed(base_dir / name, out)
            else:  # shipped whole: its shards matched the manifest, and check_manifest bound it to this entry
                continue
        except DeltaError as exc:
            raise DeltaError(f"v{version}: {exc}", base=base) from None
        except OSError as exc:
            raise DeltaError(f"v{version}: {name} could not be rebuilt from held v{base} ({exc})", base=base) from None
        if got != (entry.size, entry.sha256):
            raise DeltaError(
                f"v{version}: {name} rebuilt from held v{base} has size {got[0]} and sha256 {got[1][:12]}..., "
                f"the signed manifest says {entry.size} and {entry.sha256[:12]}... (wrong or damaged base)",
                base=base,
            )
    for entry in section:
        if entry.source != "file":
            (partial / entry.name).parent.mkdir(parents=True, exist_ok=True)
            (work / entry.name).replace(partial / entry.name)
    shutil.rmtree(work)
