#!/usr/bin/env bash
# Download, into .whl/ at the repository's root, the wheels that benchmarks/gpu_check.py
# needs on the device machine (Python 3.12, x86-64, no package index) and that its image
# lacks: jsonschema and its dependencies (the config validation) and faiss-cpu (the CPU
# side of the kNN comparison).  .whl/ is in .gitignore: the wheels travel with `run`'s
# carry [".whl"], never in a commit.  Prints each wheel's size and the total that travels
# (tracked files + .whl), which must stay under the device tool's 64 MiB.
#
# Not carried:
# * faiss-gpu 1.15.1 (pyproject's [gpu] extra): its wheel alone is 129 MiB (135,286,937
#   bytes, measured 2026-11-30), plus the nvidia-*-cu12 runtime wheels it requires; over
#   the 64 MiB budget, so gpu_check.py's GPU kNN side is torch on CUDA.
# * typing-extensions (referencing's need on Python < 3.13), numpy and packaging
#   (faiss-cpu's): already in the device image.
#
#   bash benchmarks/gpu_check_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
git check-ignore -q .whl/x || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"

# versions: the project's own environment's (pip show in .venv); one version of each
WHEELS=(
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  attrs==26.1.0
  faiss-cpu==1.15.1
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"

ls -l .whl/*.whl | awk '{printf "%10.2f MiB  %s\n", $5 / 1048576, $9}'
tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
awk -v t="$tracked" -v w="$wheels" 'BEGIN {
  printf "tracked files %.1f MiB + wheels %.1f MiB = %.1f MiB of the 64 MiB a run may carry\n",
         t / 1048576, w / 1048576, (t + w) / 1048576
  exit (t + w > 64 * 1048576) }'
