"""The command line's arguments: one parser per subcommand, each built from the parent
parsers of the concerns it has (:func:`build_parser`), so ``smallbatch <command> --help``
lists the flags that command uses and no others:

========================  ==========================================================
parent                    flags
========================  ==========================================================
``which cell``            --cell, --cell-json, --config, --cell-id
``threads``               --threads (the commands that compute)
``stand-alone cell``      --dataset, --data-root, --loss, --batch-size, --temperature,
                          --seed, --loss-param (a cell named by its settings)
``training``              --epochs, --steps, --lr, --optimizer, --backbone, ... (pretrain)
``kNN probe``             --knn-k, --knn-t, --knn-backend (knn)
``linear probe``          --linear-iterations, --linear-weight-decay(s), --linear-optimizer
``<probe> probe``         --<flag> for each of its registry ``flags`` (the other probes)
``tracking``              --tracking-uri, --experiment
``data and device``       --data-cache, --device
========================  ==========================================================

Each probe of :mod:`smallbatch.study.probe_registry` is a command of its name (``cmd_probe``).
Each subcommand's ``func`` is the name of its ``cmd_*`` function in :mod:`smallbatch.pipeline.cli`
(no import cycle).  Imports nothing heavy: the workflow's jobs parse their arguments
before anything else, so a bad flag is reported without importing torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path, PosixPath

from ..data.registry import all_specs as dataset_specs
from ..io import text_problem
from ..losses.registry import all_specs, loss_param_names
from ..study.probe_registry import all_specs as probe_specs

DEVICES = ["auto", "cpu", "cuda"]
FEATURES_HELP = "features from 'smallbatch embed' (default: <cell folder>/features.npz)"
#: the top-level help: what the commands do (each command's own line comes from its parser)
DESCRIPTION = f"""The study's command line.

cells, report and config-reference work on a whole study (its cells, its report, every config
key), init-study writes one's folder and check-loss checks a loss (a plugin's too); prepare-data, pretrain, evaluate, embed, {", ".join(probe_specs())}, baseline and export each run one step
of one cell (what the workflow's jobs run, and by hand: smallbatch <command> --help); mi runs the
MI toy. The workflow's own commands (init-store, warm-server) are left out of this list."""
#: commands the workflow runs for itself: callable, but not in the top-level list
INTERNAL_COMMANDS = ("init-store", "warm-server")


def dataset_help() -> str:
    """Every data set of the registry: ``fashion_mnist | digits | …``."""
    return " | ".join(dataset_specs())


def loss_help() -> str:
    """Every loss of the registry (its plugins' too) with its aliases: ``infonce (ntxent, simclr) | flatnce | …``."""
    return " | ".join(f"{n} ({', '.join(s.aliases)})" if s.aliases else n for n, s in all_specs().items())


def loss_param_help() -> str:
    """The loss parameters of the registry, by loss: ``loss parameter KEY=VALUE: dclw: sigma; …``."""
    per = [f"{n}: {', '.join(loss_param_names(n))}" for n in all_specs() if loss_param_names(n)]
    return "a loss parameter, e.g. sigma=0.5 (repeat for several); " + "; ".join(per)


#: the training overrides of a stand-alone or --cell-id cell: flag dest -> config key train.<dest>
TRAIN_FLAGS = ("epochs", "steps", "precision", "lr", "lr_scaling", "optimizer", "backbone", "queue_size")
#: a probe's evaluation overrides: probe -> the eval.<key> its flags override (flag dest = key)


@dataclass(frozen=True)
class BadPath:
    """A path flag's value that names no usable path; :func:`smallbatch.pipeline.cli.main` stops
    with one line naming the flag (argparse's own error would print its usage too)."""

    text: str
    kind: str = "path"  # or "name", "uri" (smallbatch.io.text_problem)

    def problem(self) -> str:
        return text_problem(self.text, self.kind) or f"= {self.text!r} is not a usable {self.kind}"


def name_value(text: str) -> str | BadPath:
    """The type of a name flag (``--experiment``): the text, or a :class:`BadPath` by the rule of
    text every name follows (:func:`smallbatch.io.text_problem`)."""
    return BadPath(text, "name") if text_problem(text, "name") else text


def uri_value(text: str) -> str | BadPath:
    """The type of ``--tracking-uri``: the text, or a :class:`BadPath` (a leading space would be read
    as part of a file-store path)."""
    return BadPath(text, "uri") if text_problem(text, "uri") else text


class FolderPath(PosixPath):
    """A path flag's value written with a trailing '/': the user named a folder (a command that
    writes one file refuses it rather than write a file of the folder's name)."""


def path_value(text: str) -> Path | BadPath:
    """The type of every path flag: a Path (a :class:`FolderPath` when it ends with '/'), or a
    :class:`BadPath` for a text that names no path (:func:`smallbatch.io.text_problem`: empty,
    starting with '~' -- no shell expanded it: a folder literally named '~' would be made -- or
    holding a control character)."""
    if text_problem(text):
        return BadPath(text)
    return FolderPath(text) if text.endswith("/") and text.strip("/") else Path(text)


def config_flag(text: str) -> dict:
    """The keywords of every command's ``--config``: repeatable, the files laid one over another
    in order (smallbatch.study.config.load_config)."""
    return {
        "type": path_value,
        "action": "append",
        "metavar": "FILE",
        "help": text + "; repeat it to lay overlays over it in order (config.yaml first)",
    }


#: ``--set``'s help (every command that reads a config takes it)
SET_HELP = (
    "override config keys for this run, laid over the --config files as one more file would be: "
    "KEY dotted, VALUE read as YAML 1.2 (a number, true, text, [0, 1], {image_size: 8}), e.g. "
    "--set grid.seeds=[0] train.epochs=2; quote a pair that holds a space for your shell"
)


def add_config(parser, text: str) -> None:
    """Add ``--config`` (:func:`config_flag`) and ``--set KEY=VALUE ...`` to ``parser`` (a parser
    or an argument group)."""
    parser.add_argument("--config", **config_flag(text))
    parser.add_argument("--set", nargs="+", action="extend", metavar="KEY=VALUE", help=SET_HELP)


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def which_cell() -> argparse.ArgumentParser:
    p = _parent()
    g = p.add_argument_group("which cell")
    g.add_argument(
        "--cell",
        type=path_value,
        help="cell JSON file (as written by 'smallbatch cells --write', or the "
        "cell.json pretraining writes into the cell's folder)",
    )
    g.add_argument("--cell-json", metavar="JSON", help="the cell itself as JSON (what the Snakemake rules pass)")
    add_config(g, "study config YAML (default values otherwise)")
    g.add_argument("--cell-id", help="id of a cell of --config, e.g. fashion_mnist/flatnce/bs32-t0.1-s0")
    return p


def threads() -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--threads", type=int, help="CPU threads (default: config threads)")
    return p


def standalone_cell() -> argparse.ArgumentParser:
    p = _parent()
    s = p.add_argument_group("stand-alone cell (when neither --cell nor --cell-id is given)")
    s.add_argument("--dataset", help=dataset_help())
    s.add_argument("--data-root", help="data root (default: config data.root)")
    s.add_argument("--loss", help=loss_help())
    s.add_argument("--batch-size", type=int, help="N images per step (2N views)")
    s.add_argument("--temperature", type=float, help="the loss's tau > 0")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--loss-param", action="append", default=[], metavar="KEY=VALUE", help=loss_param_help())
    return p


def training() -> argparse.ArgumentParser:
    p = _parent()
    t = p.add_argument_group(
        "training (override the config's train section and data set options; they "
        "change the cell's hash: name the trained cell later by its cell.json)"
    )
    t.add_argument("--epochs", type=float)
    t.add_argument("--steps", type=int, help="fixed number of steps (overrides --epochs)")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp64"])
    t.add_argument("--lr", type=float, help="learning rate at batch 256, scaled to the batch size by --lr-scaling")
    t.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"])
    t.add_argument("--optimizer", choices=["sgd", "lars", "adam"])
    t.add_argument("--backbone", choices=["small_cnn", "resnet18_cifar", "resnet50_cifar", "resnet50"])
    t.add_argument(
        "--queue-size", type=int, help="0: in-batch negatives (K = 2N-2); >0: MoCo-style queue of that many keys (K)"
    )
    t.add_argument("--image-size", type=int, help="a stand-alone cell's image side in pixels")
    t.add_argument("--train-subset", type=int, help="a stand-alone cell's pretraining images")
    return p


EVAL_NOTE = (
    "evaluation overrides: this probe only, with the cell's features and id; the result is printed "
    "(and written to --out if given), not logged to the cell's MLflow run nor written to its folder"
)


def knn_probe() -> argparse.ArgumentParser:
    p = _parent()
    g = p.add_argument_group("kNN probe", EVAL_NOTE)
    g.add_argument("--knn-k", type=int, nargs="+", metavar="K", help="neighbours, e.g. 20 200 (default: eval.knn_k)")
    g.add_argument(
        "--knn-t", type=float, metavar="T", help="temperature of the vote's weights exp(s/T) (default: eval.knn_t)"
    )
    g.add_argument(
        "--knn-backend",
        choices=["auto", "faiss-cpu", "faiss-gpu", "torch"],
        help="nearest-neighbour search (the same neighbours; default: faiss-cpu for a cpu cell, else "
        "auto: faiss, or torch on a GPU without faiss-gpu); logged like the cell's own",
    )
    return p


def linear_probe() -> argparse.ArgumentParser:
    p = _parent()
    g = p.add_argument_group("linear probe", EVAL_NOTE)
    g.add_argument(
        "--linear-iterations",
        type=int,
        metavar="N",
        help="solver iterations at most (L-BFGS; adam: epochs) (default: eval.linear_iterations)",
    )
    g.add_argument(
        "--linear-weight-decay",
        type=float,
        metavar="L2",
        help="the probe's L2 penalty (default: eval.linear_weight_decay)",
    )
    g.add_argument(
        "--linear-weight-decays",
        type=float,
        nargs="+",
        metavar="L2",
        help="choose the L2 penalty among these on a validation split of the training features "
        "(default: eval.linear_weight_decays)",
    )
    g.add_argument(
        "--linear-optimizer",
        choices=["lbfgs-precond", "lbfgs", "adam"],
        help="the solver (default: eval.linear_optimizer)",
    )
    return p


def _setting_value(text: str):
    """A probe flag's value: JSON where it parses (a number, a list), else the text; the
    command checks it against its ``eval`` key's schema."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def generic_probe(name: str) -> argparse.ArgumentParser:
    """A probe's flags from its registry entry: ``--<flag>`` overrides ``eval.<flag>``."""
    p = _parent()
    g = p.add_argument_group(f"{name} probe", EVAL_NOTE)
    for key in probe_specs()[name].flags:
        g.add_argument(
            "--" + key.replace("_", "-"), type=_setting_value, metavar="VALUE", help=f"(default: eval.{key})"
        )
    return p


def probe_parents() -> dict[str, argparse.ArgumentParser]:
    """Each probe's parent parser by its name: kNN's and the linear probe's written out, the
    others' from the registry (:func:`generic_probe`)."""
    written = {"knn": knn_probe, "linear": linear_probe}
    return {name: written.get(name, lambda n=name: generic_probe(n))() for name in probe_specs()}


def tracking() -> argparse.ArgumentParser:
    p = _parent()
    g = p.add_argument_group("tracking")
    g.add_argument(
        "--tracking-uri",
        type=uri_value,
        help="MLflow URI (default: config tracking_uri, $MLFLOW_TRACKING_URI, "
        "else sqlite:///<results_dir>/mlflow.db); 'none' disables tracking",
    )
    g.add_argument("--experiment", type=name_value, help="MLflow experiment (default: config study)")
    return p


def data_and_device() -> argparse.ArgumentParser:
    p = _parent()
    g = p.add_argument_group("data and device")
    g.add_argument("--data-cache", type=path_value, help="data cache from 'smallbatch prepare-data'")
    g.add_argument("--device", choices=DEVICES)
    return p


def verbosity(default=0) -> argparse.ArgumentParser:
    """-v / -q, accepted before the command (default 0) and after it (default: what was given before)."""
    p = _parent()
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        default=default,
        help="also print the libraries' log messages (MLflow's) and, with an error, its full traceback",
    )
    g.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        default=default,
        help="no progress bars and no warnings: results and errors only",
    )
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # start-up: only `--version` needs it

    try:
        return version("smallbatch")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        from .. import __version__

        return __version__


def build_parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smallbatch",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[verbosity()],
    )
    p.add_argument("--version", action="version", version=f"smallbatch {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parents = {
        "which": which_cell(),
        "threads": threads(),
        "standalone": standalone_cell(),
        "training": training(),
        **probe_parents(),
        "tracking": tracking(),
        "data": data_and_device(),
        "verbosity": verbosity(argparse.SUPPRESS),
    }
    add = _adder(sub, parents)
    _study_commands(add)
    _cell_commands(add)
    _probe_commands(add)
    _study_outputs(add)
    return p


def _adder(sub, parents: dict):
    """add(name, text, concerns...): a subcommand with ``text`` as its help (in the list of
    commands) and its description (in its own --help), and the parents named."""

    def add(name: str, text: str, *concerns: str, func: str | None = None) -> argparse.ArgumentParser:
        listed = {} if name in INTERNAL_COMMANDS else {"help": text}  # argparse lists a command only with a help
        c = sub.add_parser(name, description=text, parents=[parents[k] for k in (*concerns, "verbosity")], **listed)
        c.set_defaults(func=func or "cmd_" + name.replace("-", "_"))
        return c

    return add


def _study_commands(add) -> None:
    c = add("cells", "list the study's cells (id, hash, negatives K) and write their cell.json files")
    add_config(c, "study config (default: config.yaml)")
    c.add_argument("--write", action="store_true", help="write results/runs/<id>/cell.json for every cell")
    c.add_argument("--baselines", action="store_true", help="list the baseline cells too")

    c = add("init-store", "create the MLflow store's schema and the study's experiment once", "tracking")
    add_config(c, "study config (its tracking_uri and study name)")
    c.add_argument("--touch", type=path_value, help="write this marker file when done (for the workflow)")

    c = add("prepare-data", "load a data set through its real loader and cache it as one tensor file")
    add_config(c, "study config (data.root, datasets.<name> options)")
    c.add_argument("--dataset", required=True, help=dataset_help())
    c.add_argument("--data-root")
    c.add_argument("--download", action="store_true", help="let torchvision download when files are missing")
    c.add_argument("--image-size", type=int)
    c.add_argument("--train-subset", type=int)
    c.add_argument("--test-subset", type=int)
    c.add_argument("--out", type=path_value, required=True)

    add("config-reference", "print the table of every config key (CONFIGURATION.md)")

    c = add(
        "init-study",
        "write a ready study folder (Snakefile, workflow/, config.yaml, envs/) from the installed package",
    )
    c.add_argument("dir", type=path_value, metavar="DIR", help="a new or empty folder (never overwritten)")

    c = add(
        "check-loss",
        "check that a loss (a built-in's or an installed plugin's) keeps the registry's contract: a scalar "
        "from two views [N, d], finite value and gradient, τ as declared, the batch's order, its reference",
    )
    c.add_argument("name", metavar="NAME", help=loss_help())


def _pretraining(add, name: str, text: str) -> argparse.ArgumentParser:
    """A command that pretrains one cell (``pretrain``, ``run-cell``): its concerns and the
    flags of its pretraining."""
    c = add(name, text, "which", "standalone", "training", "threads", "tracking", "data")
    c.add_argument("--out", type=path_value, help="cell folder (default results/runs/<id>)")
    c.add_argument("--restart", action="store_true", help="ignore (and overwrite) a saved state.pt, e.g. a corrupt one")
    c.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, a line per 10 %% of the steps with rate and ETA in a log "
        "file; without it the log holds the summary line alone; -q does this and more)",
    )
    return c


def _cell_commands(add) -> None:
    _pretraining(add, "pretrain", "contrastive pretraining of one cell (resumes from its state.pt)")
    c = _pretraining(
        add,
        "run-cell",
        "pretrain one cell, then evaluate each of its snapshots and its final checkpoint, in this one "
        "process (what the workflow runs under one_job_per_cell: the imports paid once per cell)",
    )
    c.add_argument("--features", type=path_value, help="also write the final checkpoint's features to this .npz")

    c = add(
        "embed",
        "frozen backbone features of the train and test splits -> .npz",
        "which",
        "standalone",
        "threads",
        "data",
    )
    c.add_argument("--checkpoint", type=path_value)
    c.add_argument("--out", type=path_value)

    c = add(
        "evaluate",
        "embed + kNN + linear probe of one cell in one process, with the cell's eval settings (what the workflow runs)",
        "which",
        "standalone",
        "threads",
        "tracking",
        "data",
    )
    c.add_argument("--checkpoint", type=path_value)
    c.add_argument(
        "--out-dir",
        type=path_value,
        help="where each probe's <probe>.json goes (eval.probes; default results/runs/<id>)",
    )
    c.add_argument("--features", type=path_value, help="also write the features to this .npz")
    c.add_argument(
        "--snapshot",
        help="evaluate the snapshot of this budget (ep<e>, train.snapshot_epochs) instead of the final checkpoint: "
        "--checkpoint defaults to <cell folder>/snapshots/<snapshot>.pt, the results go to "
        "<out-dir>/<snapshot>.<probe>.json (default out-dir <cell folder>/snapshots)",
    )

    c = add(
        "export",
        "write a cell's trained backbone as a plain state dict (torch.save of its tensors: no "
        "'backbone.' prefix, no head, no optimiser) and print how to load it",
        "which",
        "standalone",
    )
    c.add_argument(
        "--run-dir",
        type=path_value,
        help="the cell's folder (results/runs/<id>): its checkpoint.pt names "
        "the cell, instead of --cell / --cell-id / a stand-alone cell",
    )
    c.add_argument(
        "--checkpoint", type=path_value, help="the checkpoint to export (default: <cell folder>/checkpoint.pt)"
    )
    c.add_argument("--out", type=path_value, help="the state dict file (default: <cell folder>/backbone.pt)")


def _probe_commands(add) -> None:
    for name, spec in probe_specs().items():  # one command per probe of the registry (plugins too)
        c = add(name, spec.title, "which", "standalone", "threads", name, "tracking", func="cmd_probe")
        c.set_defaults(probe=name)
        c.add_argument("--features", type=path_value, help=FEATURES_HELP)
        c.add_argument("--out", type=path_value, help=f"result JSON (default: <cell folder>/{spec.file})")

    c = add(
        "baseline",
        "raw-pixel or random-init encoder baseline (kNN + linear), named by --cell, --cell-json or "
        "--config with --cell-id baselines/<dataset>/<kind>",
        "which",
        "threads",
        "tracking",
        "data",
    )
    c.add_argument("--out", type=path_value, help="result JSON (default: <results_dir>/<id>/result.json)")


def _study_outputs(add) -> None:
    c = add("mi", "MI bounds on correlated Gaussians (experiments.mi); one MLflow run per row", "tracking")
    c.add_argument("--section", type=path_value, help="JSON file with the experiments.mi section")
    c.add_argument(
        "--section-json", metavar="JSON", help="the experiments.mi section itself as JSON (what the workflow passes)"
    )
    add_config(c, "study config (its experiments.mi when --section is absent)")
    c.add_argument("--out", type=path_value, default=Path("results/mi/results.json"), help="rows as JSON")

    c = add(
        "steps-to-target",
        "the critical batch size (experiments.critical_batch): steps to a target kNN accuracy on a held-out "
        "validation split per arm x batch size x seed, appended to OUT/runs.csv (a rerun skips the rows there), "
        "then the fit S = S_min (1 + B_noise / B) per arm and its figures in OUT",
    )
    add_config(c, "study config with experiments.critical_batch (e.g. workflow/configs/critical_batch.yaml)")
    c.add_argument("--out", type=path_value, required=True, help="results folder of the sweep")
    c.add_argument("--stop-by", metavar="HH:MM", help="start no run after this time (UTC, today)")
    c.add_argument("--replicas", type=int, default=1000, help="bootstrap replicas of the fit")

    c = add(
        "warm-server",
        "serve the workflow's jobs from one process that imported torch once (the workflow starts it)",
    )
    c.add_argument("--socket", required=True, help="Unix socket path to listen on")
    c.add_argument("--watch-pid", type=int, help="stop when this process (Snakemake) has ended")
    c.add_argument("--idle-timeout", type=float, default=3600.0, help="stop after this many seconds without a command")

    c = add("report", "rebuild every table and figure of a study from the MLflow store alone", "tracking")
    add_config(
        c,
        "study config (its tracking store and study name, when --tracking-uri / --experiment are not given, "
        "and its analysis plan)",
    )
    c.add_argument(
        "--out", type=path_value, default=Path("results/report"), help="report folder (default: results/report)"
    )
    c.add_argument(
        "--analysis",
        metavar="JSON",
        help="the analysis plan as a JSON object laid over the config's analysis key (the workflow passes the "
        "study's); validated like the config key",
    )
