"""The command line: ``smallbatch <command>``; the study commands (cells, report, config-reference)
work on a whole study, the others run one step of one cell (what the workflow's jobs run).

A cell is named in one of four ways:
  --cell-json '{...}'                    (the cell itself)
  --cell results/runs/<id>/cell.json     (what the Snakemake rules pass: the workflow writes it when
                                          the run starts, pretraining keeps a copy in the cell's folder)
  --config config.yaml --cell-id <id>    (a cell of a study, by its id; --config repeated: overlays)
  --dataset digits --loss flatnce --batch-size 32 --temperature 0.1 ...  (stand-alone)

Errors in the input (bad config key, batch size 1, temperature <= 0 or not finite,
missing data, a failed download, a folder that cannot be written, an unusable
tracking store, corrupt checkpoint, ...) print one line ``smallbatch: error: ...``
and exit 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from ..io import DuplicateKey, loads_unique, read_problem
from ..study.cell import BaselineCell, Cell, read_cell
from .cli_parser import TRAIN_FLAGS

if TYPE_CHECKING:
    from ..study.config import ConfigFiles

EXIT_USAGE = 2
EXIT_PREEMPTED = 143  # 128 + SIGTERM: SLURM / Snakemake may requeue or retry
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _coerce(v: str):
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return {"none": None, "null": None, "true": True, "false": False}.get(v.lower(), v)


def load_args_config(args, overrides: dict | None = None, default: ConfigFiles = None) -> dict:
    """The config of the command's ``--config`` files (or ``default``) and ``--set`` pairs, then
    ``overrides`` (smallbatch.study.config.load_config)."""
    from ..study.config import load_config

    return load_config(args.config or default, overrides, getattr(args, "set", None))


# the kind of cell follows ``baseline``: study cells come from a config's grid or the flags, and
# a baseline is named only by --cell or --cell-json (cmd_baseline), read as the kind asked for
@overload
def resolve_cell(args, baseline: Literal[False] = False) -> tuple[Cell, dict]: ...
@overload
def resolve_cell(args, baseline: Literal[True]) -> tuple[BaselineCell, dict]: ...
def resolve_cell(args, baseline: bool = False) -> tuple[Cell | BaselineCell, dict]:
    """(cell, config) from the arguments, the cell typed (:mod:`smallbatch.study.cell`); raises
    ValueError with one line.  ``baseline``: a --cell file must hold a baseline cell (else a
    study cell)."""
    from ..study.cells import expand_cells

    if getattr(args, "threads", None) is not None:  # the config's bounds (threads: 1..1024)
        from ..study.config import check_value
        from ..study.schema import load_schema

        check_value(load_schema()["properties"]["threads"], args.threads, "--threads")
    if args.cell is not None or getattr(args, "cell_json", None) is not None:
        _refuse_ignored(args, "--cell" if args.cell is not None else "--cell-json", keep=("threads",))
        cfg = load_args_config(args)
        if args.cell is not None:
            cell = _read_cell_file(args.cell, baseline)
        else:
            cell = _cell_from_text(args.cell_json, "--cell-json", baseline)
        if getattr(args, "threads", None):
            cell = cell.replaced(threads=args.threads)
        return cell, cfg
    overrides = _train_overrides(args)
    if args.cell_id:
        _refuse_ignored(args, "--cell-id", keep=("threads", "data_root", *TRAIN_FLAGS))
        if args.config is None:
            raise ValueError("--cell-id needs --config")
        cfg = load_args_config(args, overrides)
        cells = expand_cells(cfg)
        if args.cell_id not in cells:
            import difflib

            near = difflib.get_close_matches(args.cell_id, list(cells), n=3)
            raise ValueError(
                f"no cell {args.cell_id!r} in {' + '.join(map(str, args.config))}"
                + (f"; did you mean {', '.join(near)}?" if near else "")
            )
        return read_cell(cells[args.cell_id]), cfg
    obj, cfg = _standalone_cell(args, overrides)
    return read_cell(obj), cfg


#: every flag of the stand-alone group (_add_cell_args), with its empty value
STANDALONE_FLAGS: dict[str, Any] = {
    "dataset": None,
    "data_root": None,
    "loss": None,
    "batch_size": None,
    "temperature": None,
    "seed": None,
    "loss_param": [],
    **dict.fromkeys(TRAIN_FLAGS),
    "image_size": None,
    "train_subset": None,
    "threads": None,
}


def _refuse_ignored(args, mode: str, keep: tuple[str, ...]) -> None:
    """ValueError naming the first stand-alone flag given that ``mode`` (a way of naming the
    cell) would ignore: the cell comes from the file or config, not from the flags."""
    for name, empty in STANDALONE_FLAGS.items():
        if name not in keep and getattr(args, name, empty) != empty:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} has no effect with {mode} (the cell's settings come from "
                f"{'the config' if mode == '--cell-id' else 'the cell'}); leave it out, or set it "
                f"in the config, or name a stand-alone cell without {mode}"
            )


def _read_cell_file(path: Path, baseline: bool) -> Cell | BaselineCell:
    """A cell JSON file that holds every key a cell of its kind has (as `smallbatch cells
    --write` writes them); ValueError naming the file and the first missing key."""
    problem = read_problem(path)
    if problem == "does not exist":
        raise ValueError(f"cell file not found: {path}")
    if problem:
        raise ValueError(f"cell file {path} {problem}; name a cell's JSON file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cell file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    return _cell_from_text(text, f"cell file {path}", baseline)


def _cell_from_text(text: str, source: str, baseline: bool) -> Cell | BaselineCell:
    """A cell from its JSON text; ValueError naming ``source`` and the first missing key, an
    id outside the id grammar, or a hash that is not the hash of the cell's settings."""
    from ..study.cellcheck import cell_json_problem, cell_problem
    from ..study.cells import cell_hash, check_cell_id

    try:
        obj = loads_unique(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON ({exc.msg})") from None
    except DuplicateKey as exc:
        raise ValueError(f"{source} {exc}") from None
    except RecursionError:
        raise ValueError(f"{source} nests its values too deep to be read; no key of a cell nests so deep") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{source} must hold a JSON object (one cell), not a {type(obj).__name__}")
    problem = cell_json_problem(obj, baseline)  # whole, before it is typed (smallbatch.study.cellcheck)
    if problem:
        raise ValueError(f"{source} {problem}" if problem.startswith(("lacks ", "was ")) else f"{source}: {problem}")
    check_cell_id(obj["id"], f"{source}: id")
    if cell_hash(obj) != obj["hash"]:
        raise ValueError(
            f"{source}: cell {obj['id']} says hash {obj['hash']!r} but its settings hash to "
            f"{cell_hash(obj)!r} (edited by hand?); write it again with `smallbatch cells --write`, "
            "or change the config instead"
        )
    cell = (BaselineCell if baseline else Cell).from_dict(obj)
    if not baseline:  # the checks a config's cells get (an extreme tau, a k above the train set, ...)
        problem = cell_problem(cell)
        if problem:
            raise ValueError(f"{source}: cell {cell.id}: {problem}")
    return cell


def _train_overrides(args) -> dict:
    overrides: dict = {}
    for k in TRAIN_FLAGS:
        v = getattr(args, k, None)
        if v is not None:
            overrides.setdefault("train", {})[k] = v
    if getattr(args, "threads", None):
        overrides["threads"] = args.threads
    if getattr(args, "data_root", None):
        overrides.setdefault("data", {})["root"] = args.data_root
    return overrides


def _standalone_cell(args, overrides: dict) -> tuple[dict, dict]:
    """A cell from --dataset, --loss, --batch-size, --temperature ...: the flags are checked
    first (messages name them), then the config is validated with the cell as its only
    grid cell, so the study's checks (data set size, warm-up, the loss's own) apply to it."""
    from ..losses.registry import canonical_name
    from ..study.cells import make_cell
    from ..study.checks import batch_problem, tau_problem
    from ..study.config import deep_merge, validate_config

    missing = [f for f in ("dataset", "loss", "batch_size", "temperature") if getattr(args, f) is None]
    if missing:
        raise ValueError(
            "name a cell: --cell FILE, or --config with --cell-id, or give "
            + ", ".join("--" + m.replace("_", "-") for m in missing)
        )
    name = canonical_name(args.loss)  # ValueError naming the allowed losses
    for flag, problem in (
        ("--batch-size", batch_problem(args.batch_size)),
        ("--temperature", tau_problem(args.temperature)),
    ):
        if problem:  # the flag named, before the config names its grid
            raise ValueError(f"{flag} {problem}")
    given = _loss_params(name, args.loss_param)
    seed = args.seed if args.seed is not None else 0
    ds_opts = {k: getattr(args, k) for k in ("image_size", "train_subset") if getattr(args, k, None) is not None}
    base = load_args_config(args) if args.config or args.set else {}
    # the study's other data sets and side experiments stay out of a stand-alone cell
    overrides["datasets"] = {args.dataset: {**base.get("datasets", {}).get(args.dataset, {}), **ds_opts}}
    overrides["grid"] = {
        "losses": [{"name": name, **given}],
        "batch_sizes": [args.batch_size],
        "temperatures": [args.temperature],
        "seeds": [seed],
    }
    raw = deep_merge({k: v for k, v in base.items() if k not in ("datasets", "experiments", "grid")}, overrides)
    cfg = validate_config(raw)
    params = {**cfg.get("loss_params", {}).get(name, {}), **given}
    cell = make_cell(
        cfg,
        dataset=args.dataset,
        loss=name,
        loss_params=params,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=seed,
    )
    return cell, cfg


def _loss_params(name: str, pairs: list[str]) -> dict:
    """--loss-param KEY=VALUE pairs, each checked against the loss's parameter schema."""
    from ..losses.registry import loss_param_names
    from ..study.config import check_value
    from ..study.schema import load_schema

    allowed = loss_param_names(name)
    schema = load_schema()["properties"]["loss_params"]["properties"][name]["properties"]
    params = {}
    for kv in pairs:
        if "=" not in kv:
            raise ValueError(f"--loss-param must be KEY=VALUE, not {kv!r}")
        k, v = kv.split("=", 1)
        if k not in allowed:
            raise ValueError(
                f"--loss-param {k!r} is not a parameter of {name}; allowed: {', '.join(allowed) or 'none'}"
            )
        params[k] = _coerce(v)
        check_value(schema[k], params[k], f"--loss-param {k}")
    return params


def _tracking(args, cfg: dict) -> tuple[str | None, str]:
    from ..study.config import resolve_tracking_uri

    uri = args.tracking_uri
    if uri is None:
        uri = resolve_tracking_uri(cfg)
    if uri and uri.lower() == "none":
        uri = None
    return uri, args.experiment or cfg["study"]


def cell_folder(args, cell: Cell | BaselineCell, cfg: dict) -> Path:
    """The cell's folder: that of its --cell file when the file is the cell.json written into
    it (``<results>/runs/<id>/cell.json``, a baseline's ``<results>/<id>/cell.json``), else
    ``<results_dir>/runs/<id>`` (``<results_dir>/<id>``).  Its results folder is held
    (:func:`smallbatch.io.add_results_folder`): nothing is written there through a link."""
    from ..io import add_results_folder

    own = tuple(cell.id.split("/")) if isinstance(cell, BaselineCell) else ("runs", *cell.id.split("/"))
    given = getattr(args, "cell", None)
    if given is not None and given.parent.parts[-len(own) :] == own:
        root = given.parent.parents[len(own) - 1]
    else:
        root = Path(cfg["results_dir"])
    add_results_folder(root)
    return root.joinpath(*own)


# --------------------------------------------------------------------------- commands
def cmd_cells(args) -> int:
    from ..study.cells import baseline_cells, expand_cells

    cfg = load_args_config(args, default=[Path("config.yaml")])
    cells = {cid: Cell.of(c) for cid, c in expand_cells(cfg).items()}
    base = {bid: BaselineCell.of(c) for bid, c in baseline_cells(cfg).items()}
    if args.write:
        from ..io import write_json
        from ..study.config import check_results_dir

        check_results_dir(cfg)

        for cid, cell in {**cells, **base}.items():
            path = Path(cfg["results_dir"]) / ("runs" if not cid.startswith("baselines/") else "") / cid / "cell.json"
            write_json(path, cell.to_dict())
    for cid, cell in cells.items():
        print(f"{cid}\t{cell.hash}\tK={cell.negatives}")
    if args.baselines:
        for cid, cell in base.items():
            print(f"{cid}\t{cell.hash}")
    from ..study.cells import temperature_notes
    from ..study.config import sets_line

    overridden = sets_line(args.set)  # the plan says what the command line changed
    for line in ([overridden] if overridden else []) + temperature_notes(cfg):
        print(line, file=sys.stderr)
    print(f"{len(cells)} cells, {len(base)} baselines", file=sys.stderr)
    return 0


def cmd_init_store(args) -> int:
    from ..tracking import init_store

    cfg = load_args_config(args)
    uri, exp = _tracking(args, cfg)
    if uri is None:
        raise ValueError("init-store needs a tracking URI")
    eid = init_store(
        uri, exp, " + ".join(map(str, args.config)) if args.config else None
    )  # the config names the study's description
    print(f"MLflow store {uri}: experiment '{exp}' (id {eid}) ready")
    if args.touch:
        from ..io import write_text

        write_text(args.touch, f"{uri}\n{exp}\n{eid}\n")
    return 0


def cmd_prepare_data(args) -> int:
    from .jobs import prepare_data

    cfg = load_args_config(args)
    ds = {**cfg["datasets"].get(args.dataset, {})} if args.dataset in cfg["datasets"] else {}
    for k in ("image_size", "train_subset", "test_subset"):
        v = getattr(args, k)
        if v is not None:
            ds[k] = v
    from ..data.registry import all_specs

    if args.dataset not in all_specs():
        raise ValueError(f"--dataset {args.dataset!r} is not known; allowed: {', '.join(all_specs())}")
    root = args.data_root or ds.get("root") or cfg["data"]["root"]
    info = prepare_data(args.dataset, root, bool(args.download or cfg["data"]["download"]), ds, args.out)
    print(json.dumps(info))
    return 0


def cmd_pretrain(args) -> int:
    from .jobs import run_pretrain

    cell, cfg = resolve_cell(args)
    uri, exp = _tracking(args, cfg)
    out = args.out or cell_folder(args, cell, cfg)
    res = run_pretrain(
        cell,
        out,
        tracking_uri=uri,
        experiment=exp,
        cache=args.data_cache,
        restart=args.restart,
        progress=not args.no_progress and args.verbosity >= 0,
        device=args.device,
    )
    if res.pop("rank", 0) == 0:  # one summary per cell, however many processes trained it
        print(json.dumps(res))
    return 0


def cmd_embed(args) -> int:
    from .jobs import run_embed

    cell, cfg = resolve_cell(args)
    out_dir = cell_folder(args, cell, cfg)
    ckpt = args.checkpoint or out_dir / "checkpoint.pt"
    out = args.out or out_dir / "features.npz"
    _not_an_input(out, "--out", checkpoint=ckpt, data_cache=args.data_cache)
    res = run_embed(cell, ckpt, out, cache=args.data_cache, device=args.device)
    print(json.dumps(res, default=str))
    return 0


def cmd_evaluate(args) -> int:
    from ..training.checkpoint import snapshot_path
    from .jobs import run_evaluate

    cell, cfg = resolve_cell(args)
    uri, exp = _tracking(args, cfg)
    folder = cell_folder(args, cell, cfg)
    if args.snapshot is None:
        out_dir = args.out_dir or folder
        ckpt = args.checkpoint or out_dir / "checkpoint.pt"
    else:
        out_dir = args.out_dir or folder / "snapshots"
        ckpt = args.checkpoint or snapshot_path(folder, args.snapshot)
    _not_an_input(args.features, "--features", checkpoint=ckpt, data_cache=args.data_cache)
    res = run_evaluate(
        cell,
        ckpt,
        out_dir,
        tracking_uri=uri,
        experiment=exp,
        cache=args.data_cache,
        device=args.device,
        features=args.features,
        snapshot=args.snapshot,
    )
    print(json.dumps(res))
    return 0


def cmd_run_cell(args) -> int:
    """``smallbatch run-cell``: :func:`cmd_pretrain`, then :func:`cmd_evaluate` for each snapshot
    (``train.snapshot_epochs``) and last for the final checkpoint, in this one process: a
    failure anywhere leaves the final results unwritten, so the workflow's rerun repeats the
    evaluations (pretraining resumes from its finished state.pt in moments)."""
    from ..study.cell import snapshot_names

    cmd_pretrain(args)
    cell, cfg = resolve_cell(args)
    folder = args.out or cell_folder(args, cell, cfg)
    evaluate = {**vars(args), "checkpoint": None, "features": None, "snapshot": None}
    for name in snapshot_names(cell):
        cmd_evaluate(argparse.Namespace(**{**evaluate, "snapshot": name, "out_dir": Path(folder) / "snapshots"}))
    return cmd_evaluate(argparse.Namespace(**{**evaluate, "out_dir": folder, "features": args.features}))


def cmd_export(args) -> int:
    from .export import export_backbone, summary

    if args.run_dir is not None:  # the folder's checkpoint names its cell
        given = [f for f in ("cell", "cell_json", "cell_id", "dataset", "loss") if getattr(args, f) is not None]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} has no effect with --run-dir (its checkpoint names the "
                "cell); give one of them"
            )
        folder, cell = args.run_dir, None
    else:
        cell, cfg = resolve_cell(args)
        folder = cell_folder(args, cell, cfg)
    info = export_backbone(args.checkpoint or folder / "checkpoint.pt", args.out or folder / "backbone.pt", cell)
    print(summary(info), end="")
    return 0


def _cmd_probe(kind: str, args) -> int:
    from ..study.probe_registry import probe_spec
    from .jobs import run_probe

    cell, cfg = resolve_cell(args)
    uri, exp = _tracking(args, cfg)
    out_dir = cell_folder(args, cell, cfg)
    feats = args.features or out_dir / "features.npz"
    out = args.out or out_dir / probe_spec(kind).file
    _not_an_input(out, "--out", features=feats)
    overrides = _eval_overrides(kind, args)
    if overrides:  # a look at other settings: the cell's own result and MLflow run keep the study's
        cell, uri, out = cell.replaced(eval={**cell.to_dict()["eval"], **overrides}), None, args.out
        print(
            f"{cell.id}: {kind} probe with "
            + ", ".join(f"eval.{k} = {v}" for k, v in overrides.items())
            + ": not logged to MLflow"
            + ("" if out else ", not written (no --out)"),
            file=sys.stderr,
        )
    res = run_probe(
        kind, cell, feats, out, tracking_uri=uri, experiment=exp, knn_backend=getattr(args, "knn_backend", None)
    )
    print(json.dumps(res))
    return 0


def cmd_probe(args) -> int:
    """``smallbatch <probe>``: a probe of the registry (:mod:`smallbatch.study.probe_registry`) on a cell's features."""
    return _cmd_probe(args.probe, args)


def _eval_overrides(kind: str, args) -> dict:
    """The probe's evaluation flags given (its registry entry's ``flags``), each
    checked against its eval key's schema: {eval key: value}."""
    from ..study.config import check_value
    from ..study.probe_registry import probe_spec
    from ..study.schema import load_schema

    given = {k: getattr(args, k) for k in probe_spec(kind).flags if getattr(args, k, None) is not None}
    schema = load_schema()["properties"]["eval"]["properties"] if given else {}
    for key, value in given.items():
        check_value(schema[key], value, "--" + key.replace("_", "-"))
    if "linear_weight_decay" in given and "linear_weight_decays" not in given:
        given["linear_weight_decays"] = None  # the one L2 asked for, not a choice among the cell's list
    return given


def cmd_baseline(args) -> int:
    from ..study.cells import baseline_cells

    if args.cell is not None or args.cell_json is not None:
        cell, cfg = resolve_cell(args, baseline=True)
    else:
        cfg = load_args_config(args)
        cells = baseline_cells(cfg)
        if args.cell_id not in cells:
            raise ValueError(f"no baseline {args.cell_id!r}; baselines of this config: {', '.join(cells)}")
        cell = BaselineCell.of(cells[args.cell_id])
        cell = cell.replaced(threads=args.threads) if args.threads else cell
    from .jobs import run_baseline

    uri, exp = _tracking(args, cfg)
    out = args.out or cell_folder(args, cell, cfg) / "result.json"
    _not_an_input(out, "--out", data_cache=args.data_cache, cell_file=args.cell)
    res = run_baseline(cell, out, tracking_uri=uri, experiment=exp, cache=args.data_cache, device=args.device)
    print(json.dumps(res))
    return 0


def cmd_mi(args) -> int:
    from .mi_job import run_mi_step

    cfg = load_args_config(args)
    if args.section_json is not None:
        try:
            section = loads_unique(args.section_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--section-json is not valid JSON ({exc.msg})") from None
        except DuplicateKey as exc:
            raise ValueError(f"--section-json {exc}") from None
    elif args.section is not None:
        problem = read_problem(args.section)
        if problem:
            raise ValueError(
                f"section file not found: {args.section}"
                if problem == "does not exist"
                else f"section file {args.section} {problem}"
            )
        try:
            section = loads_unique(args.section.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"section file {args.section} is not valid JSON ({exc.msg})") from None
        except DuplicateKey as exc:
            raise ValueError(f"section file {args.section} {exc}") from None
    else:
        section = (cfg.get("experiments") or {}).get("mi") or {}
    if not isinstance(section, dict):
        source = "--section-json" if args.section_json is not None else f"section file {args.section}"
        raise ValueError(
            f"{source} must hold a JSON object (the experiments.mi section), not a {type(section).__name__}"
        )
    uri, exp = _tracking(args, cfg)
    res = run_mi_step(section, args.out, uri, exp, progress=args.verbosity >= 0)
    print(json.dumps({"rows": len(res["rows"]), "out": str(args.out), "seconds": round(res["seconds"], 1)}))
    return 0


def cmd_steps_to_target(args) -> int:
    from ..io import add_results_folder
    from .steps_job import run_sweep, stop_time, write_fits

    cfg = load_args_config(args)
    if not (cfg.get("experiments") or {}).get("critical_batch", {}).get("enabled"):
        raise ValueError("config key 'experiments.critical_batch.enabled' is false: enable it to run the sweep")
    stop_by = stop_time(args.stop_by) if args.stop_by else None
    add_results_folder(args.out)
    quiet = args.verbosity < 0
    run_sweep(cfg, args.out, stop_by=stop_by, log=(lambda _: None) if quiet else (lambda m: print(m, flush=True)))
    table = write_fits(args.out, replicas=args.replicas)
    if not quiet:
        print(table, end="")
    return 0


def cmd_config_reference(args) -> int:
    from ..study.config import reference_markdown

    print(reference_markdown(), end="")
    return 0


def cmd_init_study(args) -> int:
    from .study_folder import write_study

    names = write_study(args.dir)
    print(f"study written to {args.dir}: {', '.join(names)}; `cd {args.dir} && snakemake -n` plans it")
    return 0


def cmd_check_loss(args) -> int:
    """One line per broken property of the loss's contract (exit 1), or one line that it holds."""
    from ..losses.contract import PROPERTIES, contract_problems
    from ..losses.registry import loss_spec

    spec = loss_spec(args.name)
    problems = contract_problems(spec.name)
    for line in problems:
        print(f"{spec.name}: {line}")
    if not problems:
        kept = [p for p in PROPERTIES if p != "reference" or spec.reference is not None]
        print(f"{spec.name}: keeps the contract ({', '.join(kept)}{'' if spec.reference else '; no reference given'})")
    return 1 if problems else 0


def _json_object(text: str | None, flag: str) -> dict:
    """The JSON object ``text`` ({} for None); ValueError naming ``flag`` for anything else."""
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {type(obj).__name__}")
    return obj


def cmd_report(args) -> int:
    from ..report import build_report
    from ..study.config import resolve_tracking_uri

    plan = None if args.analysis is None else {"analysis": _json_object(args.analysis, "--analysis")}
    cfg = load_args_config(args, overrides=plan)
    uri = args.tracking_uri or resolve_tracking_uri(cfg)
    # Without --experiment/--config the report takes the store's only experiment.
    exp = args.experiment or (cfg["study"] if args.config else None)
    try:  # also a run of kind report
        index = build_report(uri, args.out, experiment=exp, log_run=True, analysis=cfg["analysis"])
    except (PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
        # e.g. a folder without write permission: one line, not a traceback
        raise ValueError(f"cannot write the report to {args.out}: {exc.strerror} ({exc.filename})") from None
    print(f"report written: {index}")
    return 0


def cmd_warm_server(args) -> int:
    from ..local.warm import serve

    return serve(args.socket, main, args.watch_pid, args.idle_timeout)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (:mod:`smallbatch.pipeline.cli_parser`)."""
    from .cli_parser import build_parser as build

    return build()


def main(argv: list[str] | None = None) -> int:
    """Run one command; Ctrl-C (SIGINT) anywhere in it ends it with one line and exit 130, no traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("smallbatch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    if argv is None:  # a process of its own: a workflow job may hand the command to the warm server
        from ..local.warm import delegate

        rc = delegate(sys.argv[1:])
        if rc is not None:
            return rc
    try:
        parser = build_parser()  # reads the installed loss plugins (their names are in --loss's help)
    except ValueError as exc:  # a broken plugin: its one line, as for every other input
        print(f"smallbatch: error: {_error_line(exc)}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, extra)
    _set_verbosity(args.verbosity)
    from .. import tracking
    from ..errors import Preempted

    tracking.set_source(f"smallbatch {args.command}")  # the runs it logs name it (mlflow.source.name)
    from ..local.allocator import tune

    tune()  # every step's own process (or warm-server child): freed blocks stay for the next step

    try:
        _check_paths(args)
        rc = int(globals()[args.func](args) or 0)
        _say_base(args, rc)
        return rc
    except Preempted as exc:
        print(f"smallbatch: preempted: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"smallbatch: error: {_error_line(exc)}", file=sys.stderr)
        if args.verbosity > 0:
            import traceback

            traceback.print_exc()
        return EXIT_USAGE


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """argparse's error for arguments no option takes, saying ``--set`` where one reads as a
    config override (``grid.seeds=[0]``: Hydra's and Lightning's form)."""
    from ..study.config import looks_like_override

    pairs = [a for a in extra if looks_like_override(a)]
    if pairs:
        parser.error(
            f"unrecognized arguments: {' '.join(extra)}; to override a config key write --set {' '.join(pairs)}"
        )
    parser.error(f"unrecognized arguments: {' '.join(extra)}")


#: the file each command writes, by its flag's dest: checked before any work (a device, FIFO,
#: socket, folder or link there is refused: smallbatch.io.check_target)
FILE_OUTPUTS = {
    "cmd_init_store": "touch",
    "cmd_prepare_data": "out",
    "cmd_embed": "out",
    "cmd_evaluate": "features",
    "cmd_run_cell": "features",
    "cmd_export": "out",
    "cmd_probe": "out",
    "cmd_baseline": "out",
    "cmd_mi": "out",
}


#: the folder each command writes into, by its flag's dest (a file there is refused by name)
FOLDER_OUTPUTS = {"cmd_pretrain": "out", "cmd_evaluate": "out_dir", "cmd_run_cell": "out"}


def _check_paths(args) -> None:
    """ValueError naming the first path flag whose value names no usable path
    (:class:`~smallbatch.pipeline.cli_parser.BadPath`), or the command's output file when
    it is not a regular file (:func:`smallbatch.io.check_target`)."""
    from ..io import check_target, path_kind
    from .cli_parser import BadPath, FolderPath

    try:
        os.getcwd()
    except FileNotFoundError:
        raise ValueError(
            "the working folder was deleted (or moved) under this shell; cd into a folder that exists and run it again"
        ) from None
    for dest, value in vars(args).items():
        for one in value if isinstance(value, list) else [value]:  # a repeated flag: each of its values
            if isinstance(one, BadPath):
                raise ValueError(f"--{dest.replace('_', '-')} {one.problem()}")
    flag = f"--{FILE_OUTPUTS.get(args.func, '').replace('_', '-')}"
    out = getattr(args, FILE_OUTPUTS.get(args.func, ""), None)
    if isinstance(out, FolderPath):
        raise ValueError(
            f"{flag} {out}/ ends with '/', a folder, and this command writes one file: name the file (e.g. {out}/<name>)"
        )
    if out is not None:
        check_target(out)
    folder = getattr(args, FOLDER_OUTPUTS.get(args.func, ""), None)
    if folder is not None and os.path.lexists(folder) and not os.path.isdir(folder):
        raise ValueError(
            f"--{FOLDER_OUTPUTS[args.func].replace('_', '-')} {folder} is {path_kind(folder)}, not a folder; it names "
            "the folder this command writes into: choose another path"
        )
    if args.func == "cmd_export" and out is not None and os.path.lexists(out):  # export never overwrites
        from ..io import EXISTS

        raise FileExistsError(errno.EEXIST, EXISTS, str(out))


def _not_an_input(out: Path | None, flag: str, **inputs: Path | None) -> None:
    """ValueError when the output ``out`` would replace one of the files the command reads."""
    if out is None or not Path(out).exists():
        return
    for name, path in inputs.items():
        if path is not None and Path(path).exists() and Path(out).resolve() == Path(path).resolve():
            raise ValueError(
                f"{flag} {out} is the {name.replace('_', ' ')} this command reads; refused (it would be "
                "replaced): choose another path"
            )


def _say_base(args, rc: int) -> None:
    """After a command that succeeded: one line on stderr when its first --config names no
    study, so was laid over the schema's defaults (smallbatch.study.config.base_notice); -q
    leaves it out."""
    from ..study.config import base_notice

    note = base_notice(getattr(args, "config", None)) if rc == 0 and args.verbosity >= 0 else None
    if note:
        print(f"smallbatch: {note}", file=sys.stderr)


def _set_verbosity(level: int) -> None:
    """-v: the libraries' log messages from INFO on; -q: from ERROR on, and no Python warnings."""
    import logging

    if not level:
        return
    logging.getLogger().setLevel(logging.INFO if level > 0 else logging.ERROR)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(name)s: %(message)s")
    if level < 0:
        import warnings

        warnings.simplefilter("ignore")


def _error_line(exc: BaseException) -> str:
    """One line for the user: the message's first line; an OS error (a folder that cannot
    be written, a disk that is full) as the path and the system's reason."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
