"""A cell's trained backbone as a plain state dict (``smallbatch export``), and how to load it.

``checkpoint.pt`` holds the whole contrastive model (``backbone.*`` and the projection
head's ``head.*``) with the cell and its training record.  The export is the backbone's
weights alone, keys without the ``backbone.`` prefix, written with ``torch.save`` as a
dict of tensors: ``torch.load(path, weights_only=True)`` reads it, and it loads with
``load_state_dict`` (strict) into

* the project's backbone: ``smallbatch.training.models.build_backbone(name, channels, image_size,
  width, pool_grid)`` -- every backbone;
* torchvision's model of the same architecture where there is one, with the stem and the
  pooling the cell trained: ``resnet18_cifar`` / ``resnet50_cifar`` are torchvision's
  ``resnet18`` / ``resnet50`` with a 3x3 stride-1 first convolution and no max-pool (SimCLR's
  CIFAR stem); ``resnet50`` is torchvision's ``resnet50`` (a new first convolution for
  other than 3 channels); the classifier ``fc`` is replaced by ``nn.Identity()``.  timm's
  ``resnet18`` / ``resnet50`` use torchvision's parameter names, so the same lines load
  there with ``timm.create_model(name, num_classes=0)``.  ``small_cnn`` is this project's
  own (no torchvision model).

:func:`how_to_load` writes those lines for one export, with the cell's numbers filled in
(the tests run them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io import save_torch
from ..study.cell import Cell

PREFIX = "backbone."
#: the project's backbones that are a torchvision model: name -> (torchvision constructor, CIFAR stem)
TORCHVISION = {
    "resnet18_cifar": ("resnet18", True),
    "resnet50_cifar": ("resnet50", True),
    "resnet50": ("resnet50", False),
}


def backbone_state(model_state: dict[str, Any]) -> dict[str, Any]:
    """The backbone's entries of a ContrastiveModel state dict, without the prefix."""
    return {k[len(PREFIX) :]: v for k, v in model_state.items() if k.startswith(PREFIX)}


def export_backbone(checkpoint: Path, out: Path, cell: Cell | None = None) -> dict[str, Any]:
    """Write the backbone of ``checkpoint`` (the cell's own finished checkpoint when ``cell``
    is given: another cell's or another config's is refused) to ``out``, which must not exist
    yet (nothing is overwritten), and only when every weight is finite; what was written
    and how to build the network it loads into: {cell_id, out, tensors, backbone,
    in_channels, image_size, width, pool_grid, feat_dim, mean, std}."""
    from ..training.checkpoint import load_checkpoint

    ck = load_checkpoint(checkpoint, cell=cell, kind="checkpoint")
    ckcell = _checkpoint_cell(ck)
    cid = ckcell.id if ckcell else "?"
    if ck.get("status") == "diverged":
        raise ValueError(
            f"cell {cid} diverged (checkpoint {checkpoint}): its weights are not a representation to export"
        )
    state = backbone_state(ck["model"])
    if not state or ckcell is None or "channels" not in ck:
        raise ValueError(
            f"checkpoint {checkpoint} holds no backbone of a smallbatch cell (no '{PREFIX}*' weights "
            "or no cell settings)"
        )
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise ValueError(
            f"checkpoint {checkpoint} of cell {cid}: {len(bad)} of the backbone's {len(state)} tensors hold "
            f"NaN or infinite weights (first: {bad[0]}); refused: they are not a representation to export"
        )
    tr = ckcell.train
    # never over an existing file (the cell's own checkpoint.pt included): exclusive
    save_torch(out, {k: v.detach().cpu().contiguous() for k, v in state.items()}, exclusive=True)
    info = {
        "cell_id": cid,
        "out": str(out),
        "tensors": len(state),
        "backbone": tr.backbone,
        "in_channels": int(ck["channels"]),
        "image_size": int(ck["image_size"]),
        "width": int(tr.width),
        "pool_grid": int(tr.pool_grid),
        "mean": [float(m) for m in ck.get("mean", [])],
        "std": [float(s) for s in ck.get("std", [])],
    }
    info["feat_dim"] = _feat_dim(info)
    return info


def _checkpoint_cell(ck: dict) -> Cell | None:
    """The cell a checkpoint was trained for, typed; None if it names none (not ours)."""
    try:
        return Cell.of(ck["cell"])
    except (KeyError, TypeError, AttributeError):
        return None


def _feat_dim(info: dict) -> int:
    from ..training.models import build_backbone

    return build_backbone(info["backbone"], info["in_channels"], info["image_size"], info["width"], info["pool_grid"])[
        1
    ]


def how_to_load(info: dict) -> str:
    """Python lines that load the export of :func:`export_backbone` into the project's backbone
    (``net``) and, where one fits, into torchvision's model (``tv``)."""
    path, g = info["out"], info["pool_grid"]
    lines = [
        "import torch",
        "from smallbatch.training.models import build_backbone",
        f"state = torch.load({path!r}, weights_only=True)",
        f"net, dim = build_backbone({info['backbone']!r}, in_channels={info['in_channels']}, "
        f"image_size={info['image_size']}, width={info['width']}, pool_grid={g})",
        "net.load_state_dict(state)",
        "net.eval()",
    ]
    tv = TORCHVISION.get(info["backbone"])
    if tv is not None:
        name, cifar = tv
        c = info["in_channels"]
        lines += [
            "# or torchvision's own model (timm: timm.create_model(" + repr(name) + ", num_classes=0)):",
            "import torchvision",
            "from torch import nn",
            f"tv = torchvision.models.{name}(weights=None)",
        ]
        if cifar:
            lines += [
                f"tv.conv1 = nn.Conv2d({c}, 64, kernel_size=3, stride=1, padding=1, bias=False)",
                "tv.maxpool = nn.Identity()",
            ]
        elif c != 3:
            lines += [f"tv.conv1 = nn.Conv2d({c}, 64, kernel_size=7, stride=2, padding=3, bias=False)"]
        if g != 1:
            lines += [f"tv.avgpool = nn.AdaptiveAvgPool2d({g})"]
        lines += ["tv.fc = nn.Identity()", "tv.load_state_dict(state)", "tv.eval()"]
    return "\n".join(lines) + "\n"


def summary(info: dict) -> str:
    """What ``smallbatch export`` prints: what was written, the inputs the network expects,
    then :func:`how_to_load`'s lines."""
    norm = f"(x / 255 - {info['mean']}) / {info['std']} per channel" if info["mean"] else "normalised as in training"
    head = (
        f"backbone of cell {info['cell_id']} ({info['backbone']}, {info['tensors']} tensors) written to "
        f"{info['out']}\ninputs: float images (B, {info['in_channels']}, {info['image_size']}, "
        f"{info['image_size']}) {norm}; features (B, {info['feat_dim']})\nto load it:\n"
    )
    return head + "".join("    " + ln + "\n" for ln in how_to_load(info).splitlines())
