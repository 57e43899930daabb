#!/usr/bin/env bash
# Re-resolve constraints/test.txt: the newest versions of the test tools and of everything the
# extras pull in that install beside torch 2.13.0, in a fresh venv. Then run `bash .ci/run` and
# commit the file only if it passes. The comment lines at the top of the file are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install torch==2.13.0
"$tmp/venv/bin/pip" install -e ".[test,bench,megatron,tensorboard,lightning,hf,s3,docs]" build
{
  sed -n '/^#/p' constraints/test.txt
  # torch and its CUDA packages are chosen by their own command, not pinned here.
  "$tmp/venv/bin/pip" freeze --exclude-editable | grep -viE '^(torch==|nvidia-|triton==)'
} >"$tmp/test.txt"
mv "$tmp/test.txt" constraints/test.txt
git diff --stat -- constraints/test.txt
