"""Every loss beyond the first six, and every method without negatives, trains and is evaluated
through the CLI: a digits cell of a tiny study, ``smallbatch pretrain`` then ``smallbatch
evaluate`` (the rules' commands, run in process), ends finished with its learnt parameters,
state and predictor saved, and with kNN and linear-probe accuracies and the representation's
geometry written where the workflow reads them."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from smallbatch.pipeline import cli
from smallbatch.training import loop as train

LOSSES = [
    "isogclr",
    "siglip",
    "dhel",
    "kcl",
    "simco",
    "align_uniform",
    "debiased",
    "hcl",
    "infonce_lt",
    "simsiam",
    "vicreg",
    "byol",
]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_losses")
    cfg = {
        "study": "cli-losses",
        "results_dir": str(root / "results"),
        "device": "cpu",
        "threads": 1,
        "datasets": {"digits": {}},
        "grid": {"losses": LOSSES, "batch_sizes": [32], "temperatures": [0.5], "seeds": [0]},
        "train": {"width": 4, "proj_hidden": 16, "proj_dim": 8, "epochs": 1, "log_every": 10},
        "eval": {"knn_k": [5], "linear_iterations": 30},
        "experiments": {"mi": {"enabled": False}},
    }
    path = root / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, root / "results"


@pytest.mark.parametrize("loss", LOSSES)
def test_a_digits_cell_of_the_loss_pretrains_and_evaluates_through_the_cli(loss, study):
    config, results = study
    cell_id = f"digits/{loss}/bs32-t0.5-s0"
    which = ["--config", str(config), "--cell-id", cell_id, "--tracking-uri", "none"]
    assert cli.main(["pretrain", *which, "--no-progress"]) == 0
    run = results / "runs" / cell_id
    ck = train.load_checkpoint(run / "checkpoint.pt")
    assert ck["status"] == "finished" and ck["cell"]["id"] == cell_id and math.isfinite(ck["final_loss"])
    state = train.load_checkpoint(run / "state.pt")
    owned = set(train.build_loss(loss).state_dict())  # its learnt parameters and its state
    assert set(state["loss"]) == owned and not any(v.isnan().any() for v in state["loss"].values())
    assert any(k.startswith("predictor.") for k in ck["model"]) == (loss in ("simsiam", "byol"))  # their predictor
    assert cli.main(["evaluate", *which]) == 0
    for probe in ("knn", "linear"):
        res = json.loads((run / f"{probe}.json").read_text())
        accs = [v for k, v in res.items() if "top1" in k and isinstance(v, float)]
        assert accs and all(0.0 <= a <= 100.0 for a in accs), (probe, res)
    geometry = json.loads((run / "representation.json").read_text())
    n = geometry["repr/images"]
    assert geometry["status"] == "finished" and 100 <= n <= 2000
    for space, dim in (("features", 16), ("projection", 8)):  # small_cnn at width 4: 4w channels; proj_dim
        assert 0 <= geometry[f"repr/{space}_alignment"] <= 4 and geometry[f"repr/{space}_uniformity"] <= 0
        assert 1 <= geometry[f"repr/{space}_rankme"] <= min(n, dim) + 1e-9
        assert -1 <= geometry[f"repr/{space}_neg_cos_mean"] <= 1 and geometry[f"repr/{space}_neg_cos_sd"] > 0
