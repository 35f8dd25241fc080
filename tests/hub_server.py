"""A model hub on 127.0.0.1 that speaks the part of the Hugging Face hub's HTTP API that
`huggingface_hub.snapshot_download` uses, serving local directories; what moto is to S3.

    GET  /api/models/{org}/{name}/revision/{rev}    repository info: {"id", "sha": the commit, "siblings"}
    GET  /api/models/{org}/{name}/tree/{rev}        the file list (one page): [{"type": "file", "path", "size", "oid"}]
    HEAD /{org}/{name}/resolve/{rev}/{file}         the file's metadata: ETag, X-Repo-Commit, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{file}         the file's bytes, with the same headers
Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), from which
huggingface_hub raises its typed errors. A revision is a branch name (each repository has `main`) or
the commit itself, a sha1 of the repository's files. Every file is served as a plain git blob (ETag =
its git blob sha1), never through LFS. `requests` records each request's method, path, User-Agent and
client address, so a test can tell who fetched what.

As a process of its own (the cluster in a box runs it on a host of a cluster's network):
    python -m tests.hub_server --repo ORG/NAME=DIR [--repo ...] --port 8000 --log requests.jsonl
serves until killed, writing each request as a JSON line to the log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str

    @classmethod
    def of(cls, directory: Path) -> Repo:
        files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        commit = hashlib.sha1("".join(f"{n} {git_blob_sha(d)}\n" for n, d in files.items()).encode()).hexdigest()
        return cls(files, commit)


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)
    log: Path | None = None  # where each request is also appended as a JSON line

    def add(self, repo_id: str, directory: Path) -> Repo:
        self.repos[repo_id] = Repo.of(directory)
        return self.repos[repo_id]

    def fetched_by(self) -> set[str]:
        """The User-Agents of every request but the health checks."""
        return {r["agent"] for r in self.requests if r["path"] != "/healthz"}

    def app(self) -> web.Application:
        app = web.Application()
        app.middlewares.append(self._record)
        app.router.add_get("/healthz", _healthz)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file:.+}", self._file)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler):
        record = {
            "method": request.method,
            "path": request.path,
            "agent": request.headers.get("User-Agent", ""),
            "client": request.remote,
        }
        self.requests.append(record)
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(json.dumps(record) + "\n")
        return await handler(request)

    def _lookup(self, request: web.Request) -> tuple[str, Repo]:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _error("RepoNotFound", f"Repository {repo_id} not found")
        if request.match_info["rev"] not in ("main", repo.commit):
            raise _error("RevisionNotFound", f"Invalid rev id: {request.match_info['rev']}")
        return repo_id, repo

    async def _info(self, request: web.Request) -> web.Response:
        repo_id, repo = self._lookup(request)
        return web.json_response(
            {"id": repo_id, "sha": repo.commit, "private": False, "siblings": [{"rfilename": n} for n in repo.files]}
        )

    async def _tree(self, request: web.Request) -> web.Response:
        _, repo = self._lookup(request)
        return web.json_response(
            [{"type": "file", "path": n, "size": len(d), "oid": git_blob_sha(d)} for n, d in repo.files.items()]
        )

    async def _file(self, request: web.Request) -> web.Response:
        _, repo = self._lookup(request)
        name = request.match_info["file"]
        if name not in repo.files:
            raise _error("EntryNotFound", f"{name} does not exist")
        data = repo.files[name]
        headers = {"ETag": f'"{git_blob_sha(data)}"', "X-Repo-Commit": repo.commit, "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=data, headers=headers)


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def _error(code: str, message: str) -> web.HTTPException:
    return web.HTTPNotFound(headers={"X-Error-Code": code, "X-Error-Message": message}, text=message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", action="append", default=[], help="ORG/NAME=DIR (repeatable)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()
    hub = Hub(log=args.log)
    for spec in args.repo:
        repo_id, _, directory = spec.partition("=")
        hub.add(repo_id, Path(directory))
    web.run_app(hub.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
