"""A report build stopped at any point leaves a folder the next build writes: the manifest lists
every file before it is written, and a lock keeps a second build out of a folder in use.

Each row stops the first build of one small store into a folder -- at a write of the build (an in-process Ctrl-C or a full disk), or a real ``smallbatch report``
process killed (SIGKILL) or interrupted (SIGINT) once its first table or figure is there -- and
the next build into the folder must succeed with the tables of an uninterrupted build.
"""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import HANG_S, as_foreground
from report_store import StoreBuilder

from smallbatch import io, report
from smallbatch.pipeline import cli
from smallbatch.report import context

SMALLBATCH = Path(sys.executable).with_name("smallbatch")
EXPERIMENT = "interrupted"


def _history(bs: int, seed: int) -> dict:
    return {"train/loss": [3.0 - 0.1 * s - 0.01 * seed for s in range(6)], "diag/ess": [bs / 2 + s for s in range(6)]}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Two losses x two batch sizes x two seeds, with histories (so figures are drawn)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    b = StoreBuilder(uri, EXPERIMENT)
    for loss in ("infonce", "dcl"):
        for bs in (16, 64):
            for seed in (0, 1):
                params = {"dataset": "digits", "loss": loss, "batch_size": bs, "temperature": 0.1, "seed": seed}
                b.run(
                    f"digits/{loss}/bs{bs}-t0.1-s{seed}",
                    params={**params, "epochs": 2, "pretrain_images": 1437},
                    final={"knn/top1": 60.0 + bs / 16 + seed, "linear/top1": 70.0 + bs / 32 - seed},
                    history=_history(bs, seed),
                )
    return uri


def tables(out: Path) -> dict[str, bytes]:
    """Every file of ``out``'s tables folder (hidden ones too: a killed write's leftovers), by name."""
    return {p.name: p.read_bytes() for p in sorted((out / "tables").iterdir())}


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("reference") / "report"
    report.build_report(store, out, experiment=EXPERIMENT)
    return tables(out)


def _writer(calls: list, stop_at: int = 0, exc: BaseException | None = None):
    """The atomic writer, counting its writes in ``calls``; at the ``stop_at``-th it raises ``exc``."""
    real = io.atomic_write

    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == stop_at and exc is not None:
            raise exc
        return real(path, *args, **kwargs)

    return write


#: (which of a build's writes it is stopped at, by this exception)
STOPS = [
    ("second", KeyboardInterrupt()),
    ("middle", KeyboardInterrupt()),
    ("middle", OSError(errno.ENOSPC, "No space left on device")),
    ("last", KeyboardInterrupt()),
]


@pytest.mark.parametrize("at,exc", STOPS, ids=[f"{type(e).__name__} at the {at} write" for at, e in STOPS])
def test_a_build_stopped_at_a_write_leaves_a_folder_the_next_build_writes(
    at, exc, store, reference, tmp_path, monkeypatch
):
    out, calls = tmp_path / "report", []
    with monkeypatch.context() as mp:  # a first build into a folder, its writes counted
        mp.setattr(io, "atomic_write", counting := _writer(calls))
        mp.setattr(context, "atomic_write", counting)
        report.build_report(store, tmp_path / "counted", experiment=EXPERIMENT)
    stop_at = {"second": 2, "middle": len(calls) // 2, "last": len(calls)}[at]
    with monkeypatch.context() as mp:
        mp.setattr(io, "atomic_write", stopping := _writer([], stop_at, exc))
        mp.setattr(context, "atomic_write", stopping)
        with pytest.raises(type(exc)):
            report.build_report(store, out, experiment=EXPERIMENT)
    report.build_report(store, out, experiment=EXPERIMENT)
    assert tables(out) == reference


def _report(out: Path) -> subprocess.Popen:
    argv = as_foreground([SMALLBATCH, "report", "--out", out, "--experiment", EXPERIMENT])
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_file(proc: subprocess.Popen, folder: Path) -> None:
    """Poll until ``folder`` holds a file (a hang guard, not a timing assertion)."""
    import time

    deadline = time.monotonic() + HANG_S
    while not (folder.is_dir() and any(folder.iterdir())):
        assert proc.poll() is None, f"the build ended before writing into {folder}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no file in {folder} within {HANG_S} s"
        time.sleep(0.01)


#: (signal, the folder whose first file is awaited before it is sent)
SIGNALS = [(signal.SIGKILL, "tables"), (signal.SIGINT, "tables"), (signal.SIGKILL, "figures")]


@pytest.mark.slow
@pytest.mark.parametrize("sig,folder", SIGNALS, ids=[f"{s.name} after the first {f[:-1]}" for s, f in SIGNALS])
def test_a_killed_or_interrupted_report_process_leaves_a_folder_the_next_build_writes(
    sig, folder, store, reference, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    out = tmp_path / "report"
    proc = _report(out)
    try:
        _wait_for_file(proc, out / folder)
        proc.send_signal(sig)
        err = proc.communicate(timeout=HANG_S)[1]
    finally:
        proc.kill()
    if sig == signal.SIGINT:  # Ctrl-C: one line, no traceback
        assert proc.returncode == 130 and err.strip() == "smallbatch: interrupted", (proc.returncode, err[-2000:])
    assert cli.main(["report", "--out", str(out), "--experiment", EXPERIMENT, "--tracking-uri", store]) == 0
    assert tables(out) == reference


def test_a_second_build_into_a_folder_in_use_stops_in_one_line(store, tmp_path, capsys):
    """A build holds its folder's lock (here another process holds it): a second build into the
    folder stops in one line naming the process, before writing anything."""
    out = tmp_path / "report"
    hold = (
        "import sys; from smallbatch import io, report; "
        f"lock = io.FolderLock({str(out / '.smallbatch-report.lock')!r}, 'a build', 'writing').acquire(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        rc = cli.main(["report", "--out", str(out), "--experiment", EXPERIMENT, "--tracking-uri", store])
        err = capsys.readouterr().err.strip()
    finally:
        holder.kill()
        holder.wait(timeout=HANG_S)
    assert rc == 2 and err == (
        f"smallbatch: error: report folder {out} is being written by process {holder.pid} "
        f"(lock {out}/.smallbatch-report.lock); wait for it to finish or stop it first"
    ), err
    assert not (out / "tables").exists()
