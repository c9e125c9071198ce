"""The allocator's settings (smallbatch.local.allocator): freed activation-sized blocks stay in the
heap, so a step no longer faults their pages in again; every command sets them."""

import json
import subprocess
import sys
import textwrap

import pytest

from smallbatch.local import allocator

_FAULTS = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from smallbatch.local import allocator
    tuned = allocator.tune() if sys.argv[1] == "tuned" else None
    def cycle():  # what a training step does with its activations: allocate 8 maps of 16 MiB, free them
        maps = [np.empty(4 << 20, np.float32) for _ in range(8)]
        for a in maps:
            a.fill(1.0)
        del maps
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        cycle()
    print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
""")


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_heap_keeps_freed_blocks():
    plain, tuned = _faults("plain"), _faults("tuned")
    assert tuned["tuned"] is True
    # untuned: glibc hands part of the freed 128 MiB back (trimmed or unmapped) and faults it
    # in again (measured: ~4,000 pages a cycle); tuned: the heap keeps it
    assert plain["faults"] > 20 * 2000, plain
    assert tuned["faults"] < 200, tuned


def test_every_command_tunes(monkeypatch, capsys):
    from smallbatch.pipeline import cli

    calls = []
    monkeypatch.setattr(allocator, "tune", lambda: calls.append(1) or True)
    assert cli.main(["config-reference"]) == 0
    assert "batch_sizes" in capsys.readouterr().out
    assert calls == [1]
