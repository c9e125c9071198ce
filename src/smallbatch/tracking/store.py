"""The study's experiment in a store, and where a run's artifacts are (a SQLite store's proxied root, wherever the folder now is)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlparse

from .base import (
    ARTIFACTS_DIR,
    EXPERIMENT_KIND,
    FORMAT,
    KIND_PARENT,
    KIND_REPORT,
    PROXIED_ROOT,
    TAG_CELL,
    TAG_EXPERIMENT_KIND,
    TAG_FORMAT,
    TAG_HASH,
    TAG_KIND,
    TAG_NOTE,
    TrackingError,
    format_problem,
)
from .client import check_mlflow_server, is_http, store_client, tracking_uri_problem, wrap
from .sqlite import build_sqlite_store, remove_dead_builds, sqlite_file, sqlite_path


def artifacts_root(uri: str) -> Path | None:
    """A SQLite store's artifact folder (beside the database, as its URI names it), else None."""
    db = sqlite_file(uri)
    return None if db is None else Path(str(db).split("?", 1)[0]).parent / ARTIFACTS_DIR


def describe_study(experiment: str, config: str | None = None) -> str:
    """The experiment's description (tag ``mlflow.note.content``): the study, its config, what a run is."""
    cfg = f" from the config `{config}`" if config else ""
    return (
        f"smallbatch study **{experiment}**{cfg}: one run per cell (run name = cell id; tags "
        f"`{TAG_CELL}`, `{TAG_HASH}`, `{TAG_KIND}` = cell | baseline | mi | {KIND_PARENT} | {KIND_REPORT}). "
        "A cell's artifacts: its resolved config (`cell.json`), its evaluation (`knn.json`, `linear.json`, "
        "`representation.json`), "
        "its backbone when `tracking.log_checkpoint` is on. The side experiments' rows are nested under a "
        f"parent run; the report is a run of kind `{KIND_REPORT}` with its tables and figures. Training "
        "curves: x-axis `train/images_seen` or `epoch` compares batch sizes (the step is the optimiser's). "
        "Params are text (sorted as text); the numeric settings are also metrics `setting/<name>` "
        "(`setting/batch_size`, `setting/temperature`, ...), which sort as numbers. "
        f"Browse: `mlflow ui --backend-store-uri sqlite:///mlflow.db` in the folder holding the store "
        f"(its artifacts are `./{ARTIFACTS_DIR}`); in Python: `smallbatch.tracking.artifact_path(uri, run_id)`."
    )


def _create_experiment(client, uri: str, experiment: str, note: str) -> str:
    from mlflow.entities import ExperimentTag

    tags = [
        ExperimentTag(TAG_NOTE, note),
        ExperimentTag(TAG_FORMAT, str(FORMAT)),
        ExperimentTag(TAG_EXPERIMENT_KIND, EXPERIMENT_KIND),
    ]
    if sqlite_file(uri) is None:  # a server or another store: its own artifact root
        return client.create_experiment(experiment, tags={t.key: t.value for t in tags})
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    # the store's default root, not an explicit location: MLflow makes an explicit one absolute
    return SqlAlchemyStore(uri, PROXIED_ROOT).create_experiment(experiment, tags=tags)


def _check_named(uri: str, experiment: str, exp) -> None:
    """TrackingError unless the store's answer for ``experiment`` is that experiment, with an id."""
    if not exp.experiment_id or exp.name != experiment:
        raise TrackingError(
            f"MLflow tracking store {uri} answered experiment {experiment!r} with id {exp.experiment_id!r} and "
            f"name {exp.name!r}: not an MLflow tracking server; check --tracking-uri / tracking_uri"
        )


def check_format(uri: str, exp) -> None:
    """TrackingError when experiment ``exp`` was written in another format than this smallbatch's."""
    problem = format_problem(
        f"experiment '{exp.name}' of the store {uri}",
        exp.tags.get(TAG_FORMAT),
        "run the study into a new store (another results_dir or tracking_uri), or read this one "
        "with the smallbatch that wrote it",
    )
    if problem:
        raise TrackingError(problem)


def get_or_create_experiment(uri: str, experiment: str, note: str | None = None) -> str:
    client = store_client(uri)
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            _check_named(uri, experiment, exp)
            check_format(uri, exp)
            if note and exp.tags.get(TAG_NOTE) != note:
                client.set_experiment_tag(exp.experiment_id, TAG_NOTE, note)
            if note and TAG_EXPERIMENT_KIND not in exp.tags:  # a study's store made before: opens as training too
                client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
            return exp.experiment_id
        try:
            return _create_experiment(client, uri, experiment, note or describe_study(experiment))
        except Exception:
            exp = client.get_experiment_by_name(experiment)  # created by a parallel job
            if exp is None:
                raise
            return exp.experiment_id
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
        raise wrap(uri, f"opening experiment '{experiment}'", exc) from None


def init_store(uri: str, experiment: str, config: str | None = None) -> str:
    """Create the store's schema and the study's experiment (described: :func:`describe_study`)
    once; return its id.  A new SQLite store comes into existence whole (:func:`build_sqlite_store`)
    with the proxied artifact root, so even MLflow's own 'Default' experiment names no absolute
    folder (the creator's ./mlruns).  An existing one MLflow cannot complete (half-built by an
    interrupted creation or migration) fails in one line saying how to recover (:func:`wrap`)."""
    db = sqlite_file(uri)
    if db is not None and not uri.startswith("sqlite:///file:") and not tracking_uri_problem(uri):
        path = sqlite_path(uri)
        remove_dead_builds(path)
        if not path.exists():
            try:
                build_sqlite_store(uri, path)
            except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
                raise wrap(uri, "creating the store", exc) from None
    eid = get_or_create_experiment(uri, experiment, describe_study(experiment, config))
    if is_http(uri):  # a server that took the request may still be no MLflow server
        check_mlflow_server(uri)
    return eid


def local_artifacts(uri: str, artifact_uri: str):
    """The artifact repository of a run whose root is proxied (``mlflow-artifacts:/...``) in a
    SQLite store: the folder :func:`artifacts_root` holds, wherever the study folder now is;
    None for any other root (MLflow's client resolves it)."""
    root = artifacts_root(uri)
    if root is None or not artifact_uri.startswith("mlflow-artifacts:"):
        return None
    rel = Path(urlparse(artifact_uri).path.lstrip("/"))
    if not rel.parts or ".." in rel.parts or rel.is_absolute():
        raise TrackingError(f"MLflow store {uri}: artifact root {artifact_uri!r} is not a path inside {root}")
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    return LocalArtifactRepository(str((root / rel).resolve()))


def artifact_path(uri: str, run_id: str) -> Path:
    """The local folder holding a run's artifacts, wherever the study folder now is: a SQLite
    store's proxied root (:func:`local_artifacts`) or a ``file:`` one (a store made before).
    MLflow's own client cannot read a proxied root through a ``sqlite:`` URI (it asks an
    ``mlflow server`` for it), and a ``file:`` root MLflow always makes absolute, which a moved
    study folder breaks: so the store keeps the proxied root, and this is how a script reads
    the artifacts without a server (``mlflow ui`` started in the store's folder serves them).
    TrackingError for a run whose artifacts are on a server or another remote store."""
    client = store_client(uri)
    try:
        root = client.get_run(run_id).info.artifact_uri
    except Exception as exc:  # noqa: BLE001
        raise wrap(uri, f"reading run {run_id}", exc) from None
    repo = local_artifacts(uri, root)
    if repo is not None:
        return Path(repo.artifact_dir)
    if urlparse(root).scheme in ("", "file"):
        from mlflow.utils.file_utils import local_file_uri_to_path

        return Path(local_file_uri_to_path(root))
    raise TrackingError(
        f"run {run_id}'s artifacts are at {root}, not in a local folder: read them with MLflow's client "
        f"(MlflowClient('{uri}').download_artifacts)"
    )


def run_artifacts(uri: str, artifact_uri: str):
    """The artifact repository of a run's artifact root (:func:`local_artifacts` for a SQLite
    store's proxied root, MLflow's own for any other)."""
    repo = local_artifacts(uri, artifact_uri)
    if repo is None:
        from mlflow.store.artifact.artifact_repository_registry import (
            get_artifact_repository,
        )

        repo = get_artifact_repository(artifact_uri, tracking_uri=uri)
    return repo


def delete_run(client, uri: str, run) -> None:
    """Delete a run, its artifacts first where they can be (MLflow keeps a deleted run's)."""
    with contextlib.suppress(Exception):
        run_artifacts(uri, run.info.artifact_uri).delete_artifacts()
    client.delete_run(run.info.run_id)
