"""The report as the experiment's one run of kind ``report``, replaced in place when the report changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .base import KIND_REPORT, TAG_COMMIT, TAG_HASH, TAG_KIND, TAG_NOTE
from .client import store_client, wrap
from .provenance import git_commit, source_tags
from .runs import CellRun, find_runs, open_cell_run
from .store import delete_run, get_or_create_experiment, run_artifacts


def log_report_run(uri: str, experiment: str, out_dir: str | Path, files: list[Path]) -> str:
    """Log a built report as the experiment's one run of kind ``report`` (run name ``report``):
    its files as artifacts (``index.md``, ``tables/...``, ``figures/...``).  Its hash tag is the
    files' content: the same report built again leaves the run as it is; a changed one replaces
    the run's artifacts and tags in the same run (its id stays).  Report runs beside it (several
    builds of a store from before) are deleted, artifacts first.  Returns its id."""
    out = Path(out_dir)
    rels = sorted((Path(f).relative_to(out).as_posix(), Path(f)) for f in files)
    digest = hashlib.sha1()
    for rel, f in rels:
        digest.update(rel.encode() + b"\0" + f.read_bytes())
    key = {"id": KIND_REPORT, "hash": digest.hexdigest()[:10], "experiment": KIND_REPORT}
    client, latest = _latest_report_run(uri, experiment)
    if latest is not None and latest.data.tags.get(TAG_HASH) == key["hash"] and latest.info.status == "FINISHED":
        return latest.info.run_id
    run = _emptied(client, uri, latest) if latest is not None else None
    if run is None:
        run = open_cell_run(uri, experiment, key, kind=KIND_REPORT, fresh=True)
    else:
        run.set_tags({TAG_HASH: key["hash"], TAG_COMMIT: git_commit(), **source_tags()})
    for rel, f in rels:
        run.log_artifact(f, str(Path(rel).parent) if "/" in rel else None)
    run.set_tags({TAG_NOTE: f"The study's report ({len(rels)} files): open `index.md` among the artifacts."})
    run.set_status("finished")
    return run.run_id


def _latest_report_run(uri: str, experiment: str):
    """(client, the experiment's newest report run or None); every older one is deleted."""
    exp_id = get_or_create_experiment(uri, experiment)
    client = store_client(uri)
    try:
        runs = [r for r in find_runs(client, exp_id, KIND_REPORT, None) if r.data.tags.get(TAG_KIND) == KIND_REPORT]
        for old in runs[1:]:
            delete_run(client, uri, old)
    except Exception as exc:  # noqa: BLE001
        raise wrap(uri, "finding the report's run", exc) from None
    return client, (runs[0] if runs else None)


def _emptied(client, uri: str, latest) -> CellRun | None:
    """The report run ``latest`` with its artifacts deleted, RUNNING again, to log a new
    build into; None when its store cannot delete them (the run is deleted instead)."""
    try:
        run_artifacts(uri, latest.info.artifact_uri).delete_artifacts()
    except Exception:  # noqa: BLE001 - artifacts that cannot be deleted: a new run instead
        try:
            delete_run(client, uri, latest)
        except Exception as exc:  # noqa: BLE001
            raise wrap(uri, "replacing the report's run", exc) from None
        return None
    run = CellRun(uri, latest.info.run_id, client, resumed=True, cell_id=KIND_REPORT)
    run.set_status("running")
    return run
