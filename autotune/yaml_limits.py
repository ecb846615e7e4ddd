"""YAML read with limits: a hostile or broken file is one clear error, never a traceback.

PyYAML's ``safe_load`` builds no arbitrary objects, but it still reads any size, recurses once
per nesting level (a deep file is a ``RecursionError``), shares aliased nodes so that an alias
bomb (anchors of anchors) is small in memory until something walks it, and lets a repeated key
win silently. ``load_yaml`` bounds the first three and refuses the last, with its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from autotune.errors import UserError

#: far above any search space or configuration file (the default space is ~4 KB)
MAX_BYTES = 1_000_000
MAX_DEPTH = 32
#: nodes of the document once every alias is expanded (what a walk over the result visits)
MAX_NODES = 100_000
_MERGE = "tag:yaml.org,2002:merge"


class YamlLimit(Exception):
    """A limit or rule of this loader; ``line`` is 1-based where known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader with a depth bound while composing and no duplicate mapping keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlLimit(f"nested deeper than {MAX_DEPTH} levels", mark.line + 1)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue  # `<<: *base` merges on purpose; its keys may be overridden
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error says so
            if first != line:
                raise YamlLimit(f"duplicate key {key!r} (first at line {first})", line)
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


def _expanded_size(root: Node) -> int:
    """Nodes of the document with every alias expanded, counted without expanding it."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            sizes[id(node)] = 1
            continue
        if children_done:
            sizes[id(node)] = min(MAX_NODES + 1, 1 + sum(sizes.get(id(c), 0) for c in children))
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def parse_yaml(text: str, source: str) -> Any:
    """The document in ``text``; any problem is a ``UserError`` naming ``source`` and the line."""
    loader = _LimitedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise YamlLimit(f"expands to more than {MAX_NODES:,} values (aliases of aliases?)")
        return loader.construct_document(node)
    except YamlLimit as exc:
        at = f"line {exc.line}: " if exc.line else ""
        raise UserError(f"{source}: {at}{exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}: invalid YAML: {at}{problem}") from None
    finally:
        loader.dispose()


def load_yaml(path: Path, what: str) -> Any:
    """Read and parse a user's YAML (or JSON) file: size, encoding, depth and aliases bounded."""
    source = f"{what} {path}"
    if not path.exists():
        raise UserError(f"{what} file not found: {path}")
    if not path.is_file():
        raise UserError(f"{source}: not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{source}: cannot read it: {exc.strerror}") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{source}: larger than {MAX_BYTES:,} bytes; is it the right file?")
    if b"\x00" in data:
        raise UserError(f"{source}: a binary file, not YAML text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(f"{source}: line {line}: not UTF-8 text; save it as UTF-8") from None
    return parse_yaml(text, source)
