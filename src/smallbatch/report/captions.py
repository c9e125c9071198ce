"""Captions of the report's tables and figures in ``snakemake --report`` (one place).

:func:`captions` gives ``(file-name prefix, caption)`` pairs for the report rule's params,
which ``workflow/report/table.rst`` and ``figure.rst`` read: the sections every study has
(here) and each side experiment's own (its entry in :mod:`smallbatch.study.experiments`).  A file
takes the caption of the longest prefix its name starts with.  :func:`labels` names each entry of
the report's lists by its caption's head and its file, not by its path.
"""

from __future__ import annotations

import re

from ..study.experiments import SPECS

TABLES = (
    ("grid_top1_", "Top-1 accuracy per loss and batch size: mean ± sd over seeds."),
    ("grid_temperature_", "Top-1 accuracy per temperature and batch size."),
    (
        "grid_dependence_",
        "How strongly each loss depends on the batch size: the small-to-large gap with its seed-paired interval.",
    ),
    ("grid_gain_", "Each cell's gain over the best baseline."),
    (
        "grid_pooled_",
        "Small − large batch pooled over the losses (an additive fit of loss and seed to the seed-paired differences), "
        "with its interval and test.",
    ),
    (
        "representation_",
        "What each representation looks like per loss and batch size (alignment, uniformity, RankMe, the spread of "
        "negative cosines on held-out views; training's q_B and batch covariance rank): mean ± sd over seeds.",
    ),
    ("baselines", "The baselines: raw pixels and a random-init encoder, through the same probes."),
    ("diverged_runs", "Runs that diverged, collapsed or failed (they contribute no number)."),
    ("papers_reported", "The numbers the papers report, per paper with source and status."),
    ("papers_vs_ours_gap", "The small-vs-large batch gap in the papers next to ours, per loss family."),
    ("cost_", "What the study cost: wall and CPU seconds per run, per section and in all."),
)

FIGURES = (
    (
        "accuracy_vs_batch_",
        "Top-1 accuracy against batch size, one panel per probe (kNN, linear): dots are the seeds, a bar their range "
        "and the open marker their mean; grey lines the baselines; the top axis the optimiser steps each batch size "
        "took.",
    ),
    (
        "accuracy_vs_images_",
        "The kNN monitor's top-1 on held-out training images against images seen, one colour per batch size: at equal "
        "images a smaller batch has taken more optimiser steps.",
    ),
    (
        "mi_fraction_",
        "InfoNCE's mutual-information bound saturation (diag/mi_fraction) over training, one line per batch size, "
        "mean ± sd over seeds.",
    ),
    (
        "qb_",
        "q_B per batch size (diag/qb_mean over the second half of training, all seeds): the negative-positive "
        "coupling that DCL removes.",
    ),
    ("ess_", "Effective sample size of the negatives' weights (diag/ess) over training, one line per batch size."),
    (
        "representation_",
        "What each representation looks like against batch size, per loss: alignment and uniformity of the "
        "L2-normalised projections of two held-out views (Wang & Isola 2020, alpha = 2, t = 2), RankMe of the "
        "features and of the projections (exp of the entropy of the normalised singular values), the sd of the "
        "cosines between different images' projections, and training's last q_B (contrastive losses only); on a "
        "fixed sample of 2,000 test images in eval mode. Points are seeds, lines means with their 95 % t interval.",
    ),
)


def captions(kind: str) -> list[list[str]]:
    """``[prefix, caption]`` for every table (``kind="tables"``) or figure (``"figures"``),
    longest prefix first, so the first one a name starts with is the most specific."""
    if kind not in ("tables", "figures"):
        raise ValueError(f"kind must be 'tables' or 'figures', not {kind!r}")
    pairs = [*(TABLES if kind == "tables" else FIGURES), *(p for s in SPECS.values() for p in getattr(s, kind))]
    return [[prefix, text] for prefix, text in sorted(pairs, key=lambda p: -len(p[0]))]


def caption_of(name: str, kind: str) -> str:
    """The caption a table or figure called ``name`` gets ('' when no prefix matches)."""
    return next((text for prefix, text in captions(kind) if name.startswith(prefix)), "")


#: a label is a caption's first sentence, cut within this many characters where it is longer
HEAD_CHARS = 100


def caption_head(text: str) -> str:
    """The first sentence of ``text``; past :data:`HEAD_CHARS`, cut (with an ellipsis) at its last
    comma, semicolon, colon or opening parenthesis outside parentheses before them, so that no
    parenthesis is left open."""
    head = re.split(r"\.(?:\s|$)", text, maxsplit=1)[0].strip()
    if len(head) <= HEAD_CHARS:
        return head
    depth, cut = 0, 0
    for i, ch in enumerate(head[:HEAD_CHARS]):
        if ch == "(" and depth == 0:
            cut = i
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch in ",;:" and depth == 0:
            cut = i
    return head[:cut].rstrip() + " …" if cut else head[:HEAD_CHARS] + " …"


def labels(name: str, kind: str) -> dict[str, str]:
    """The labels ``snakemake --report`` lists a table (``kind="tables"``) or figure (``"figures"``)
    called ``name`` by: its caption's head, and its file (its name where no caption matches)."""
    head = caption_head(caption_of(name, kind))
    return {"caption": head or name, "file": f"{name}{'.png' if kind == 'figures' else '.csv'}"}
