#!/usr/bin/env bash
# CI: the reconciliation on Spark 3.5, the clusters' line (EMR 7, Databricks LTS), beside the
# dev venv's 4.2 that make test / make test-more run. A venv of its own holds what a user gets
# with `pip install 'crossdc[reconcile]' 'pyspark==3.5.7'` plus the pytest plugins of the dev
# extra; in it the installed pyspark's major.minor picks the 3.5 connector
# (dr/reconcile/pom-spark-3.5.xml, Scala 2.12, fetched by Maven into the cache like 4.2's), and
# the reconciliation's integration tests run against the real two regions:
#
#   tests/unit/test_spark_line.py                 the line, its pom and the refusals
#   tests/integration/test_reconcile.py           the job in-process and under spark-submit
#   tests/integration/test_reconcile_journal.py   the proxies' journals read beside the data
#
#   .ci/spark35.sh        (SPARK35_VENV=/some/dir: where the venv lives; kept and reused)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${CROSSDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/crossdc}"
venv="${SPARK35_VENV:-$cache/venv-spark35}"  # kept across clones: pip's work once per machine
pyspark="3.5.7"  # = dr/reconcile/pom-spark-3.5.xml's spark.version
started=$SECONDS

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
# The pytest plugins as the dev extra pins them (not the whole dev extra: no 4.2 pyspark).
plugins=$("$venv/bin/python" - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
print(" ".join(d for d in dev if d.split(">")[0].split("=")[0].startswith("pytest")))
EOF
)
# Editable, from this checkout (reinstalled each run: a clone elsewhere moves it), as the
# Makefile installs the dev venv.
client=()
[[ -f "$repo/client/pyproject.toml" ]] && client=(-e "$repo/client")
# shellcheck disable=SC2086  # $plugins: one requirement a word
"$venv/bin/pip" install -q "${client[@]}" -e "$repo[reconcile]" "pyspark==$pyspark" $plugins
got=$("$venv/bin/python" -c "import pyspark; print(pyspark.__version__)")
if [[ "$got" != "$pyspark" ]]; then
  echo "spark35: the venv has pyspark $got, not $pyspark" >&2
  exit 1
fi
"$venv/bin/python" -c "from dr.reconcile.spark_line import check_spark
from dr.stack.paths import StackPaths
line = check_spark()
print(f'spark35: pyspark $got, connector {line.connector} (Scala {line.scala}),',
      StackPaths.default().spark_pom.name)"
echo "spark35: venv ready ($((SECONDS - started)) s)"

cd "$repo"
# -m 'not chaos': the modules' slow tests too (pyproject's addopts deselects them).
"$venv/bin/python" -m pytest -p no:cacheprovider -m "not chaos" \
  tests/unit/test_spark_line.py \
  tests/integration/test_reconcile.py \
  tests/integration/test_reconcile_journal.py
echo "spark35: done ($((SECONDS - started)) s)"
