"""What the report says, its data say: a table of stores whose runs the report once read
wrongly, each built and reported for real (a SQLite store through ``StoreBuilder``).

* a metric that is not a finite accuracy (NaN in one seed, 150 %, -20 %) makes its run a
  failed run: listed with the failed runs, said in a note, never averaged nor dropped
  without a word, and the seeds count says how many entered;
* the unit of an accuracy is the one its run records (``smallbatch.accuracy_unit``), never
  guessed from the values: a store whose every accuracy is below 1 % stays below 1 %;
* index.md names its store without an absolute path (a copied study's report names its own).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from report_store import StoreBuilder

from smallbatch import report
from smallbatch.tracking import TAG_ACCURACY_UNIT


def _params(bs: int, seed: int) -> dict:
    return {"dataset": "digits", "loss": "infonce", "batch_size": bs, "temperature": 0.1, "seed": seed}


@dataclass(frozen=True)
class Store:
    name: str
    #: (batch size, seed) -> the final metrics a run logged (knn/top1, linear/top1)
    finals: dict
    unit: str | None = None  # the runs' recorded accuracy unit; None: not recorded (read as percent)
    #: (batch size, seed) of the runs the report must list as failed, with the metric it names
    failed: dict = field(default_factory=dict)
    #: (batch size, metric) -> (mean shown in grid_top1.csv, seeds that entered)
    shown: dict = field(default_factory=dict)
    #: (batch size, seed) -> params logged instead of the cell's own (a store edited by hand)
    logged: dict = field(default_factory=dict)
    #: (batch size, seed) -> the run's status (default finished)
    status: dict = field(default_factory=dict)
    #: (batch size, seed) -> what a note must say of a run left out without being failed
    noted: dict = field(default_factory=dict)


STORES = [
    Store(
        "NaN in one seed",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}, (16, 1): {"knn/top1": 82.0, "linear/top1": math.nan}},
        failed={(16, 1): "linear/top1 = nan"},
        shown={(16, "linear"): (85.0, 1), (16, "knn"): (80.0, 1)},
    ),
    Store(
        "accuracies of 150 and -20",
        {
            (16, 0): {"knn/top1": 150.0, "linear/top1": 85.0},
            (16, 1): {"knn/top1": 81.0, "linear/top1": -20.0},
            (16, 2): {"knn/top1": 82.0, "linear/top1": 86.0},
        },
        failed={(16, 0): "knn/top1 = 150", (16, 1): "linear/top1 = -20"},
        shown={(16, "linear"): (86.0, 1), (16, "knn"): (82.0, 1)},
    ),
    Store(
        "a collapsed many-class study below 1 % (percent, not recorded)",
        {(16, 0): {"knn/top1": 0.9, "linear/top1": 0.8}, (16, 1): {"knn/top1": 0.7, "linear/top1": 1.0}},
        shown={(16, "knn"): (0.8, 2), (16, "linear"): (0.9, 2)},
    ),
    Store(
        "fractions, recorded as such",
        {(16, 0): {"knn/top1": 0.9, "linear/top1": 0.8}, (16, 1): {"knn/top1": 0.7, "linear/top1": 1.0}},
        unit="fraction",
        shown={(16, "knn"): (80.0, 2), (16, "linear"): (90.0, 2)},
    ),
    Store(
        "an unknown unit",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}},
        unit="permille",
        failed={(16, 0): "records its accuracies in 'permille'"},
    ),
    Store(
        "batch_size '16.5' in a batch-16 cell",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}, (16, 1): {"knn/top1": 90.0, "linear/top1": 95.0}},
        logged={(16, 1): {"batch_size": "16.5"}},
        failed={(16, 1): "logged batch_size = '16.5', not a whole number"},
        shown={(16, "knn"): (80.0, 1), (16, "linear"): (85.0, 1)},
    ),
    Store(
        "seed 'abc'",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}, (16, 1): {"knn/top1": 90.0, "linear/top1": 95.0}},
        logged={(16, 1): {"seed": "abc"}},
        failed={(16, 1): "logged seed = 'abc', not a whole number"},
        shown={(16, "knn"): (80.0, 1), (16, "linear"): (85.0, 1)},
    ),
    Store(
        "two runs of one cell both logging seed 0",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}, (16, 1): {"knn/top1": 90.0, "linear/top1": 95.0}},
        logged={(16, 1): {"seed": 0}},
        failed={(16, 1): "logged seed = '0', but its cell id names 1"},
        shown={(16, "knn"): (80.0, 1), (16, "linear"): (85.0, 1)},
    ),
    Store(
        "a RUNNING run with metrics",
        {(16, 0): {"knn/top1": 80.0, "linear/top1": 85.0}, (16, 1): {"knn/top1": 90.0, "linear/top1": 95.0}},
        status={(16, 1): "running"},
        noted={(16, 1): "is still running (or was killed before it ended): its metrics are not counted"},
        shown={(16, "knn"): (80.0, 1), (16, "linear"): (85.0, 1)},
    ),
]


@pytest.fixture(scope="module")
def reports(store_uri, tmp_path_factory) -> dict[str, tuple[Path, pd.DataFrame]]:
    """Each store of STORES as an experiment of one SQLite store, and its report."""
    built = {}
    for i, st in enumerate(STORES):
        b = StoreBuilder(store_uri, experiment=f"store{i}")
        tags = {TAG_ACCURACY_UNIT: st.unit} if st.unit else {}
        for (bs, seed), final in st.finals.items():
            params = {**_params(bs, seed), **st.logged.get((bs, seed), {})}
            status = st.status.get((bs, seed), "finished")
            b.run(f"digits/infonce/bs{bs}-t0.1-s{seed}", params=params, final=final, tags=tags, status=status)
        out = tmp_path_factory.mktemp(f"report{i}") / "report"
        index = report.build_report(store_uri, out, experiment=f"store{i}")
        built[st.name] = (index, b)
    return built


def _key(cell_id: str) -> tuple[int, int]:
    """(batch size, seed) of ``digits/infonce/bs<N>-t0.1-s<S>``, as the table names its runs."""
    bs, seed = re.fullmatch(r"digits/infonce/bs(\d+)-t0\.1-s(\d+)", cell_id).groups()
    return int(bs), int(seed)


@pytest.mark.parametrize("st", STORES, ids=[s.name for s in STORES])
def test_the_report_says_what_its_runs_logged(st, reports):
    index, builder = reports[st.name]
    text = index.read_text()
    failed = pd.read_csv(index.parent / "tables" / "diverged_runs.csv")
    ids = {r["run_id"]: _key(r["cell_id"]) for r in builder.logged}
    listed = {ids[r] for r in failed.loc[failed["status"] == "failed", "run_id"]}
    assert listed == set(st.failed), failed
    for (bs, seed), what in {**st.failed, **st.noted}.items():
        rid = next(r for r, key in ids.items() if key == (bs, seed))
        assert re.search(rf"Run {rid} \(cell digits/infonce/bs{bs}-t0\.1-s{seed}\) .*{re.escape(what)}", text), text
    for (bs, metric), (mean, n) in st.shown.items():
        grid = pd.read_csv(index.parent / "tables" / f"grid_top1_digits_{metric}.csv")
        row = grid[grid["batch_size"] == bs].iloc[0]
        assert row["mean"] == pytest.approx(mean) and row["n_seeds"] == n, row
        seeds = "1 seed" if n == 1 else f"{n} seeds"
        assert f"over the seeds that gave a number ({seeds} per cell)" in text


def test_index_names_its_store_without_an_absolute_path(reports, store_uri):
    index, _ = reports[STORES[0].name]
    text = index.read_text()
    store = store_uri[len("sqlite:///") :]
    assert store not in text and str(Path(store).parent) not in text, text[:600]
    assert str(index.parent) not in text
    relative = Path(store).relative_to(Path(store).anchor)  # the rebuild command runs from the report folder
    shown = re.search(r"in the store `sqlite:///([^`]+)`", text).group(1)
    assert (index.parent / shown).resolve() == Path(store).resolve(), (shown, relative)
