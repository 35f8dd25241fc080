"""YAML as rlfleet reads a user's file: PyYAML's safe loader, except that a key given twice in one mapping is an error.

YAML 1.2 says the keys of a mapping are unique, but PyYAML keeps the last value of a repeated key without a word, so
`groupSize: 8` and, further down the same block, `groupSize: 4` would validate and run with 4. Kubernetes' strict
decoding refuses such a file, naming the key and its line; `kubectl apply` of an rlfleet file does, and so does
`rlfleet run`/`validate`/`render` through this loader.
A key that a merge (`<<: *anchor`) brings in and the mapping then sets itself is not a repeat: overriding a merged
key is what merges are for. Only the keys written in the mapping itself are compared, before the merge is applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from yaml.nodes import MappingNode

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one mapping; `line` is the second occurrence's, `first_line` the first's (from 1)."""

    def __init__(self, key: object, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(
            f'line {line}: key "{key}" is already set at line {first_line} of this mapping; give each key once'
        )


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader whose mappings refuse a repeated key (DuplicateKeyError)."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[object, int] = {}  # each key written in the mapping itself -> its line
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise DuplicateKeyError(key, line, lines[key])
                lines[key] = line
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it below
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The one document in `text` (yaml.safe_load, strict about repeated keys)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506  # StrictLoader is a SafeLoader


def load_all(text: str) -> Iterator[Any]:
    """Every document in `text` (yaml.safe_load_all, strict about repeated keys)."""
    return yaml.load_all(text, Loader=StrictLoader)  # noqa: S506  # StrictLoader is a SafeLoader
