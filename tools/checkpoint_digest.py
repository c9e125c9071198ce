"""Train one tiny real cell through the CLI and print the SHA-256 of its tensors.

The digest covers every tensor of ``checkpoint.pt`` (the model) and of ``state.pt`` (model,
optimiser, negatives source, scaler) in sorted key order -- the tensors' bytes, dtype and
shape, not the file, whose zip carries paths and metadata.  Two trainings of the same cell
on the same machine and code must print the same digest; a restructuring that changes no
number keeps it.

    python tools/checkpoint_digest.py [--config workflow/configs/smoke.yaml]
        [--cell-id digits/infonce/bs64-t0.5-s0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _walk(obj, prefix: str, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _walk(obj[k], f"{prefix}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}/{i}", out)


def tensor_digest(path: Path) -> tuple[str, int]:
    """SHA-256 over (key, dtype, shape, bytes) of every tensor in the file; and their count."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    tensors: list = []
    _walk(obj, "", tensors)
    h = hashlib.sha256()
    for key, t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest(), len(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "workflow" / "configs" / "smoke.yaml"))
    ap.add_argument("--cell-id", default="digits/infonce/bs64-t0.5-s0")
    ap.add_argument("--keep", help="train into this folder (kept) instead of a temporary one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp) / "cell"
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        cmd = [
            sys.executable,
            "-m",
            "smallbatch",
            "pretrain",
            "--config",
            args.config,
            "--cell-id",
            args.cell_id,
            "--tracking-uri",
            "none",
            "--no-progress",
            "--threads",
            "1",
            "--restart",
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        for name in ("checkpoint.pt", "state.pt"):
            if (out / name).exists():
                digest, n = tensor_digest(out / name)
                print(f"{name}\t{n} tensors\t{digest}")


if __name__ == "__main__":
    main()
