#!/usr/bin/env bash
# Regenerate the Python stubs of protos/minedraft/v1/*.proto into minedraft/v1/.
# Usage: scripts/gen_protos.sh [--check]   (--check: exit 1 when the committed stubs are stale)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=minedraft/v1
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$PY" -m grpc_tools.protoc -I protos --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" protos/minedraft/v1/*.proto
  if ! diff -r -x __init__.py -x __pycache__ "$tmp/minedraft/v1" "$out" >/dev/null; then
    echo "generated stubs in $out are stale: run 'make protos'" >&2; exit 1
  fi
  echo "protos: stubs up to date"; exit 0
fi
"$PY" -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/minedraft/v1/*.proto
touch minedraft/__init__.py "$out/__init__.py"
