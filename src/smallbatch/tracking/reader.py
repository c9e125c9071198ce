"""Read-only access to an existing store, for the report: never creates one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import STATUS_FINISHED, STATUS_RUNNING, TAG_STATUS, TrackingError
from .client import bounded_client, connection_refused, wrap
from .sqlite import check_existing_store
from .store import check_format, local_artifacts

#: MLflow's run status -> ours, for a run without the TAG_STATUS tag
_MLFLOW_STATUS = {
    "FINISHED": STATUS_FINISHED,
    "RUNNING": STATUS_RUNNING,
    "SCHEDULED": STATUS_RUNNING,
    "FAILED": "failed",
    "KILLED": "failed",
}


class StoreReader:
    """Read-only access to an existing tracking store, for the report.

    Opening never creates a store: a ``sqlite:///`` path must be an existing
    SQLite file with MLflow's tables, a local folder store must exist.  HTTP
    requests run under the retry caps of :func:`load_mlflow`, so a stopped server
    fails within seconds.  Every failure is a :class:`TrackingError` of one line
    (``no MLflow server at <URI>`` when nothing answers at the address).
    """

    def __init__(self, uri: str):
        self.uri = str(uri)
        check_existing_store(self.uri)
        self._client = self._call("opening the store", lambda: bounded_client(self.uri))

    def _call(self, what: str, fn):
        try:
            return fn()
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
            if connection_refused(exc):
                raise TrackingError(f"no MLflow server at {self.uri} (nothing answered while {what})") from None
            raise wrap(self.uri, what, exc) from None

    def experiment(self, name: str | None) -> tuple[str, str]:
        """(id, name) of experiment ``name``; None picks 'smallbatch' or the store's only experiment.

        ValueError naming the store's experiments when there is no such experiment or no
        unambiguous default.
        """
        if name is not None:
            exp = self._call(f"reading experiment '{name}'", lambda: self._client.get_experiment_by_name(name))
            if exp is None:
                names = sorted(e.name for e in self._experiments())
                raise ValueError(
                    f"no runs in experiment {name!r} at URI {self.uri!r} "
                    f"(no such experiment; available: {', '.join(names) or 'none'})"
                )
            if getattr(exp, "lifecycle_stage", "active") == "deleted":
                raise ValueError(
                    f"experiment {name!r} at URI {self.uri!r} was deleted; restore it "
                    f"(mlflow experiments restore --experiment-id {exp.experiment_id}) to read its runs"
                )
            check_format(self.uri, exp)
            return exp.experiment_id, exp.name
        exps = [e for e in self._experiments() if e.name != "Default"]
        chosen = [e for e in exps if e.name == "smallbatch"] or (exps if len(exps) == 1 else [])
        if chosen:
            check_format(self.uri, chosen[0])
            return chosen[0].experiment_id, chosen[0].name
        names = sorted(e.name for e in exps)
        raise ValueError(
            f"experiment must be given: the store at URI {self.uri!r} holds "
            f"{len(names)} experiments ({', '.join(names) or 'none'}) and none is named 'smallbatch'"
        )

    def _experiments(self) -> list:
        return self._call("listing experiments", lambda: list(self._client.search_experiments()))

    def runs(self, experiment_id: str) -> list[dict[str, Any]]:
        """Every active run of the experiment: ``run_id, run_name, status`` (TAG_STATUS, else
        MLflow's mapped to ours), ``start_time`` (ms), ``tags``, ``params``, ``metrics`` (latest)."""
        runs: list = []
        token = None
        while True:
            page = self._call(
                "searching runs",
                lambda token=token: self._client.search_runs([experiment_id], max_results=5000, page_token=token),
            )
            runs.extend(page)
            token = page.token
            if not token:
                break
        return [
            {
                "run_id": r.info.run_id,
                "run_name": r.info.run_name,
                "start_time": r.info.start_time or 0,
                "status": r.data.tags.get(TAG_STATUS) or _MLFLOW_STATUS.get(r.info.status, r.info.status.lower()),
                "tags": dict(r.data.tags),
                "params": dict(r.data.params),
                "metrics": dict(r.data.metrics),
            }
            for r in runs
        ]

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every logged value of metric ``key`` of one run."""
        hist = self._call(f"reading the history of {key}", lambda: self._client.get_metric_history(run_id, key))
        return [(m.step, m.value) for m in hist]

    def _artifact_repo(self, run_id: str):
        """(repo, None) for a proxied root in a SQLite store (:func:`local_artifacts`), else (None, client)."""
        run = self._call(f"reading run {run_id}", lambda: self._client.get_run(run_id))
        return local_artifacts(self.uri, run.info.artifact_uri)

    def artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        """The artifact paths of a run (files, recursively) under ``path``."""
        repo = self._artifact_repo(run_id)
        lister = repo.list_artifacts if repo is not None else (lambda p: self._client.list_artifacts(run_id, p))
        out: list[str] = []
        for info in self._call("listing artifacts", lambda: lister(path)):
            out += self.artifacts(run_id, info.path) if info.is_dir else [info.path]
        return sorted(out)

    def download_artifact(self, run_id: str, path: str, dst: str | Path) -> Path:
        """Copy one artifact of a run into the folder ``dst``; return its local path."""
        repo = self._artifact_repo(run_id)
        Path(dst).mkdir(parents=True, exist_ok=True)
        return Path(
            self._call(
                f"downloading the artifact {path}",
                lambda: (
                    repo.download_artifacts(path, str(dst))
                    if repo is not None
                    else self._client.download_artifacts(run_id, path, str(dst))
                ),
            )
        )
