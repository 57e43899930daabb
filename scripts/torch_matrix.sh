#!/usr/bin/env bash
# Run the core suite (save, load, records, flat plans, staging, DCP interop) against each torch
# version given, each in a fresh venv:  bash scripts/torch_matrix.sh 2.9.1 2.15.0
#
# PyPI's torch wheels are CUDA builds of several GB: a deliberate download, not part of CI.
# The test tools come from constraints/test.txt, as in the README's test command; torch is
# the one named. A machine-wide pip constraint capping torch (as /etc/xdg/pip may hold) is
# pip's config: run with PIP_CONFIG_FILE=/dev/null to lift it for one call.
# Prints one line per version and exits non-zero if any failed. Logs: $MATRIX_LOGS (default
# a temporary folder, printed).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -eq 0 ]; then
  echo "usage: $0 TORCH_VERSION..." >&2
  exit 2
fi
python=${PYTHON:-python3}
logs=${MATRIX_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
tests=(tests/test_engine.py tests/trainer/test_load.py tests/formats/test_records.py tests/staging/test_flatplan.py
  tests/staging/test_staging_copy.py tests/test_roundtrip.py)

failed=0
summary=()
for version in "$@"; do
  venv=$(mktemp -d)/venv
  log="$logs/torch-$version.log"
  echo "torch $version: venv $venv, log $log"
  if ! {
    "$python" -m venv "$venv" &&
      "$venv/bin/pip" install "torch==$version" &&
      "$venv/bin/pip" install -c constraints/test.txt -e ".[test]"
  } >"$log" 2>&1; then
    summary+=("torch $version: install failed (see $log)")
    failed=1
  else
    # The worktree's asyncckpt, whatever other install the machine has.
    PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" \
      >>"$log" 2>&1
    rc=$?
    got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    summary+=("torch $got: $(tail -n 1 "$log") (pytest exit $rc)")
    [ "$rc" -eq 0 ] || failed=1
  fi
  rm -rf "$(dirname "$venv")"
done
printf '%s\n' "${summary[@]}"
exit "$failed"
