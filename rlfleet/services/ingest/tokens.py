"""The ingest's written tokens: a `{worker_id: token}` file (spec.ingest.tokensFile, `--tokens-file`)
read and checked once, and the lookup of the worker a presented token belongs to.

The lookup compares the presented token with every written one (hmac.compare_digest, no early
exit), so its time does not tell how much of a token was right. Tokens of workers that joined
through the door are stored hashed in Redis instead (door.py).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from rlfleet.config import ConfigError
from rlfleet.services.ingest.door import read_secret_file


def load_tokens(path: str | Path) -> dict[str, str]:
    """Read a YAML/JSON `{worker_id: token}` file; raise ConfigError naming what is wrong."""
    source = str(path)
    data = read_secret_file(path, "tokens")
    if not isinstance(data, dict) or not data:
        raise ConfigError(source, ["tokens file must be a non-empty mapping {workerId: token}"])
    problems = [
        f"{worker!r}: token must be a non-empty string"
        for worker, token in data.items()
        if not isinstance(token, str) or not token
    ]
    if not problems and len(set(data.values())) != len(data):
        problems.append("two workers share a token; give each worker its own")
    if problems:
        raise ConfigError(source, problems)
    return {str(worker): token for worker, token in data.items()}


class TokenBook:
    """token -> worker id, looked up in constant time per entry (hmac.compare_digest, every entry)."""

    def __init__(self, tokens: dict[str, str]):
        self._entries = [(token.encode(), worker) for worker, token in tokens.items()]

    def worker_for(self, token: str) -> str | None:
        presented, found = token.encode(), None
        for known, worker in self._entries:
            if hmac.compare_digest(presented, known):
                found = worker
        return found
