"""tools/mutate.py's list stays in step with the code: a mutant whose snippet moved on would be
reported as stale by the script, never run, and the suite's guard of that line would go
unmeasured without anybody noticing."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutants_snippet_occurs_exactly_once_in_its_file():
    mutate = _mutate()
    stale = [f"{m.file}: {m.what}" for m in mutate.MUTANTS if (ROOT / m.file).read_text().count(m.original) != 1]
    assert not stale, stale


def test_every_mutated_file_has_tests_that_guard_it():
    mutate = _mutate()
    unguarded = sorted({m.file for m in mutate.MUTANTS} - set(mutate.TESTS))
    assert not unguarded, unguarded


def test_every_guarding_test_exists():
    """A test file (or test) named in TESTS that does not exist is left out of the mutants'
    runs without a word: each entry names a test file of the tree, and a named test is in it."""
    mutate = _mutate()
    missing = []
    for file, tests in mutate.TESTS.items():
        for test in tests:
            path, _, name = test.partition("::")
            text = (ROOT / path).read_text() if (ROOT / path).is_file() else None
            if text is None or (name and f"def {name.split('[')[0]}(" not in text):
                missing.append(f"{file}: {test}")
    assert not missing, missing
