"""The default study's cell hashes, pinned in ``tests/fixtures/default_cell_hashes.json``.

For every cell and baseline of ``config.yaml`` the golden file holds its hash and the payload
the hash covers (``cells.hashed_settings``), so a test that finds a hash moved names the keys
whose change moved it.  The cells are expanded with ``data.root`` in an empty folder: where
the data lie is not hashed, and Fashion-MNIST's digest is then that of the content of Debian's
``dataset-fashion-mnist`` package (the IDX files decompressed: the same bytes as an unpacked
copy), so the file is the same on any machine with that package, whatever its ``results/``
holds.

Regenerate it (only when a change of what a hash covers is intended -- every finished
result of the old hashes is then rerun -- in its own commit that says which keys moved and
why)::

    PYTHONPATH=src python tests/cell_hashes.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from smallbatch.study.cells import baseline_cells, expand_cells, hashed_settings
from smallbatch.study.config import load_config

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "fixtures" / "default_cell_hashes.json"


def default_cells(data_root: Path) -> dict[str, dict]:
    """The cells and baselines of the default study, its data read under ``data_root``."""
    cfg = load_config(REPO / "config.yaml", {"data": {"root": str(data_root)}})
    return {**expand_cells(cfg), **baseline_cells(cfg)}


def golden_entries(cells: dict[str, dict]) -> dict[str, dict]:
    """{cell id: {"hash": its hash, "hashed": the payload it covers}}."""
    return {cid: {"hash": c["hash"], "hashed": hashed_settings(c)} for cid, c in cells.items()}


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def moved_keys(old: dict, new: dict) -> list[str]:
    """The hashed keys that differ between two payloads, each with its value then and now."""
    a, b = _flat(old), _flat(new)

    def shown(flat: dict, key: str) -> str:
        return json.dumps(flat[key]) if key in flat else "(not hashed)"

    return [
        f"{k}: {shown(a, k)} -> {shown(b, k)}"
        for k in sorted(a.keys() | b.keys())
        if (k in a) != (k in b) or a.get(k) != b.get(k)
    ]


def write_golden() -> None:
    with tempfile.TemporaryDirectory() as empty:
        entries = golden_entries(default_cells(Path(empty)))
    GOLDEN.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    print(f"wrote the hashes of {len(entries)} cells to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {sys.argv[0]} --write  (regenerates {GOLDEN})")
    write_golden()
