"""The forms of a YAML config that YAML 1.1 and YAML 1.2 read differently, found before a
value is used.

PyYAML (and Snakemake, which reads ``--configfile`` itself) reads YAML 1.1: ``1:30`` is 90
(base 60), ``010`` is 8 (octal), ``yes``/``on`` are true, ``2024-01-01`` a date, ``1_000``
1000, while ``1e-3`` and ``1.0e6`` stay text.  YAML 1.2 reads each of these the other way.
A plain scalar whose two readings differ is refused with one line naming its key, its line
and both readings (:func:`ambiguities`), so the study never runs on a value its author did
not mean; as are a mapping with two ``<<`` merge keys (one would be dropped) and a key that
is not text (``~: 1``, ``1: x``).  A tree whose aliases expand to more values than any study's
config holds (an alias bomb: a kilobyte nesting 10^8 values) is refused before anything walks
it (:func:`expanded_values`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import yaml

_INT = re.compile(r"[-+]?[0-9]+")
_OCT = re.compile(r"0o[0-7]+")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")
_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"


def yaml12(text: str) -> Any:
    """The value of a plain scalar in YAML 1.2's core schema."""
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE", "false", "False", "FALSE"):
        return text.lower() == "true"
    if _INT.fullmatch(text):
        return int(text, 10)
    if _OCT.fullmatch(text):
        return int(text[2:], 8)
    if _HEX.fullmatch(text):
        return int(text[2:], 16)
    if _FLOAT.fullmatch(text):
        return float(text)
    if _INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.fullmatch(text):
        return math.nan
    return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _shown(value: Any) -> str:
    return f"the text {value!r}" if isinstance(value, str) else repr(value)


#: the most values a config file may hold once its aliases are expanded: far more than a study's
#: config, far fewer than an alias bomb (whose validation would walk every one of them)
MAX_VALUES = 100_000


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def expanded_values(node: yaml.Node, limit: int = MAX_VALUES) -> int:
    """How many nodes ``node``'s tree holds with every alias expanded, counted up to ``limit + 1``
    (more is not counted); each node's count is computed once, so an alias bomb costs what it
    is long.  A node that holds itself (an alias inside its own anchor) counts ``limit + 1``."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if done:
            active.discard(id(n))
            total = 1 + sum(sizes.get(id(k), limit + 1) for k in _children(n))
            sizes[id(n)] = max(sizes.get(id(n), 0), min(total, limit + 1))
        elif id(n) in active:
            sizes[id(n)] = limit + 1
        elif id(n) not in sizes:
            active.add(id(n))
            stack.append((n, True))
            stack += [(k, False) for k in _children(n) if id(k) not in sizes]
    return sizes[id(node)]


def too_large(node: yaml.Node) -> str | None:
    """One line (without the file's name) when ``node``'s tree expands to more than
    :data:`MAX_VALUES` values, else None."""
    if expanded_values(node) <= MAX_VALUES:
        return None
    return (
        f"its aliases (*name) expand to more than {MAX_VALUES} values (an alias bomb, or an alias inside its "
        "own anchor); write the values out, or alias fewer times"
    )


def ambiguities(loader: yaml.SafeLoader, node: yaml.Node) -> Iterator[str]:
    """One line (without the file's name) for each form of ``node``'s tree that YAML 1.1 and
    1.2 read differently, each naming its key and line."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(node, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:  # an alias: checked where it was anchored
            continue
        seen.add(id(node))
        line = node.start_mark.line + 1
        if isinstance(node, yaml.ScalarNode):
            problem = _scalar(loader, node, where or "<top level>", line)
            if problem:
                yield problem
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{where}[{i}]") for i, item in reversed(list(enumerate(node.value)))]
        elif isinstance(node, yaml.MappingNode):
            yield from _mapping(loader, node, where, line)
            for key, value in reversed(node.value):
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((value, f"{where}.{name}" if where else str(name)))


def _scalar(loader: yaml.SafeLoader, node: yaml.ScalarNode, where: str, line: int) -> str | None:
    if node.style is not None or node.tag == _MERGE:  # quoted: text in both; a merge key: _mapping
        return None
    if not node.tag.startswith("tag:yaml.org,2002:"):
        return f"key '{where}' (line {line}) has the tag {node.tag!r}; write the plain value"
    v11, v12 = _constructed(loader, node), yaml12(node.value)
    if _same(v11, v12):
        return None
    return (
        f"key '{where}' = {node.value} (line {line}) reads as {_shown(v11)} in YAML 1.1 and as {_shown(v12)} "
        "in YAML 1.2; write it so both read the same (a plain decimal number, true or false, or the text "
        "in quotes)"
    )


def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, where: str, line: int) -> Iterator[str]:
    merges = [key.start_mark.line + 1 for key, _ in node.value if key.tag == _MERGE]
    if len(merges) > 1:
        yield (
            f"mapping {where or '<top level>'} (line {line}) has {len(merges)} '<<' merge keys (lines "
            f"{', '.join(map(str, merges))}); YAML keeps only one of them: write one '<<: [*a, *b]'"
        )
    for key, _ in node.value:
        if key.tag == _MERGE or not isinstance(key, yaml.ScalarNode) or key.style is not None:
            continue
        read = [_constructed(loader, key), yaml12(key.value)]
        if not all(isinstance(v, str) for v in read):
            inside = f" under '{where}'" if where else ""
            value = next(v for v in read if not isinstance(v, str))
            yield (
                f"the key {key.value or repr('')}{inside} (line {key.start_mark.line + 1}) is not a name (YAML "
                f"reads it as {value!r}); a config key is text: quote it, or remove it"
            )


def _constructed(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    """The value YAML 1.1 (PyYAML) gives a plain scalar."""
    try:
        return loader.yaml_constructors[node.tag](loader, node)
    except (yaml.YAMLError, ValueError, KeyError, TypeError):
        return node.value
