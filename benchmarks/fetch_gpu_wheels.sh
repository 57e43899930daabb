#!/usr/bin/env bash
# Download, into .whl/ at the repository root, the wheels the GPU machines lack (device tool:
# /work/.library/device/KINDS.md lists what their image holds; no package registry there).
# Run here before a device `run` that calls benchmarks/gpu_suite.sh, and name `.whl` in carry.
#
# Missing there: crc32c (an asyncckpt dependency), trio (+ outcome, sniffio) and pytest-asyncio
# (test dependencies). anyio, psutil, numpy, rich, pytest, hypothesis, attrs, sortedcontainers,
# idna, typing-extensions and xxhash are in the image. Python 3.12, manylinux x86_64. One version of
# each: two versions of one package stop the install there.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  crc32c==2.9.post0
  trio==0.35.0
  outcome==1.3.0.post0
  sniffio==1.3.1
  pytest-asyncio==1.5.0
)
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
# Each must be there exactly once (a second version would stop pip there).
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  n=$(find .whl -maxdepth 1 -iname "${name//-/_}-*.whl" | wc -l)
  if [ "$n" -ne 1 ]; then
    echo "fetch_gpu_wheels: expected one wheel for $name, found $n" >&2
    exit 1
  fi
done
du -sh .whl
