#!/usr/bin/env bash
# CI: crossdc as a user installs it. A fresh venv, `pip install .` (no dev extras), and the
# CLI run from a folder outside the checkout: its error paths must each end in one line and
# the documented exit code, never in a traceback (defect 10: a user's install has no `click`
# and no checkout around it).
#
#   .ci/clean-venv.sh            (CLEAN_VENV_DIR=/some/dir to keep and reuse the venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
base="${CLEAN_VENV_DIR:-$(mktemp -d -t crossdc-clean-XXXXXX)}"
venv="$base/venv"
work="$(mktemp -d -t crossdc-user-XXXXXX)"   # the user's folder: no policies/, no checkout

if [[ ! -x "$venv/bin/dr" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "$repo"
fi
if "$venv/bin/python" -c "import pytest" 2>/dev/null; then
  echo "clean-venv: the venv holds dev extras (pytest); it must not" >&2; exit 1
fi

cd "$work"
cp "$repo/policies/topology.local.yaml" "$work/topology.yaml"
cp "$repo/policies/default.yaml" "$work/policy.yaml"
unset CROSSDC_TOPOLOGY
export CROSSDC_STATE_DIR="$work/state" CROSSDC_CACHE_DIR="$work/cache" COLUMNS=200
export PATH="$venv/bin:$PATH"

failed=0
# check CODE LINES -- command...: exit status CODE, no traceback anywhere, and (LINES > 0)
# exactly LINES non-empty lines on stderr.
check() {
  local want="$1" lines="$2"; shift 3
  local out err code
  out="$(mktemp)"; err="$(mktemp)"
  set +e; timeout 120 "$@" >"$out" 2>"$err"; code=$?; set -e
  local n; n=$(grep -c . "$err" || true)
  if grep -q -e Traceback -e ModuleNotFoundError "$out" "$err"; then
    echo "FAIL (traceback): $*"; cat "$err"; failed=1
  elif [[ "$code" != "$want" ]]; then
    echo "FAIL (exit $code, want $want): $*"; cat "$err"; failed=1
  elif [[ "$lines" -gt 0 && "$n" -ne "$lines" ]]; then
    echo "FAIL ($n lines on stderr, want $lines): $*"; cat "$err"; failed=1
  else
    echo "ok   (exit $code): $*"
    [[ "$lines" -gt 0 ]] && sed 's/^/       /' "$err"
  fi
  rm -f "$out" "$err"
}

check 0 0 -- dr --help
check 0 0 -- python -m dr.reconcile --help
check 0 0 -- dr topology validate topology.yaml
check 2 1 -- dr status --bogus
check 2 1 -- dr topology validate /nonexistent
check 2 1 -- dr status
check 2 1 -- dr reconcile --regions a,b --topics x
check 2 1 -- python -m dr.reconcile --regions a,b --topics x
check 2 1 -- dr reconcile --regions east,mars --topics x -t topology.yaml
check 2 1 -- dr reconcile --regions east,west --topics x -t topology.yaml --state "$work"
check 1 1 -- dr reconcile --regions east,west --topics x -t topology.yaml --out /proc/crossdc
check 2 1 -- dr proxy serve --region mars -p policy.yaml
check 2 1 -- dr proxy serve --region mars -p policy.yaml -t topology.yaml
check 2 1 -- dr proxy serve --region east -p policy.yaml -t topology.yaml --tls-cert x.pem
check 2 1 -- dr offsets translate --group g --from mars --to west -t topology.yaml
check 2 1 -- dr mirror run --from mars --to west --topics x -t topology.yaml
check 2 1 -- dr mirror run --from east --to east --topics x -t topology.yaml
check 2 1 -- dr mirror run --from east --to west --topics '([' -t topology.yaml
check 2 1 -- dr drill --scenario datacenter-fire -t topology.yaml
check 2 1 -- dr drill --scenario primary-outage -t topology.yaml --max-rto-s -1
check 2 1 -- dr drill --scenario primary-outage -t topology.yaml --config /nonexistent
check 1 1 -- dr drill --scenario primary-outage -t topology.yaml --dry-run
check 2 1 -- dr demo -t topology.yaml
check 2 1 -- dr prometheus config --target bad

rm -rf "$work"
[[ -n "${CLEAN_VENV_DIR:-}" ]] || rm -rf "$base"
if [[ "$failed" != 0 ]]; then echo "clean-venv: FAILED"; exit 1; fi
echo "clean-venv: every error path is one line, no traceback"
