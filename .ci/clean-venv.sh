#!/usr/bin/env bash
# CI: crossdc as a user installs it. The two distributions are built once into wheels, from
# the checkout's sources only (tracked and new files: never the stubs a dev venv generated, so
# the client wheel's crossdc_client/_proto must come from its build hook), then installed into
# fresh venvs (python -m venv + pip; uv is not assumed):
#
#   client  `pip install crossdc-client`, what an application gets: grpcio and protobuf, none
#           of aiokafka, confluent-kafka, py-consul, aiohttp, typer, rich, cryptography (nor
#           pydantic, PyYAML, structlog, tenacity, crossdc's own packages). The SDK imports,
#           and produces and consumes a record through a real proxy: the dev venv's pytest runs
#           tests/integration/test_client_install.py (its stack and proxy) with
#           CROSSDC_CLIENT_PYTHON set to this venv's python, which runs the application.
#
#   lean    `pip install crossdc` (with crossdc-client, its dependency), what a proxy host gets: no pyspark, matplotlib,
#           testcontainers, grpcio-tools or dev tools. The CLI, `dr proxy serve --help`,
#           the proxy's gRPC stubs and aiokafka's codecs (cramjam) load; every error path (bad options, hostile files, a
#           command that needs an extra) ends in one line and the documented exit code,
#           never a traceback, run from a folder outside the checkout (defect 10: a user's
#           install has no `click` and no checkout around it).
#   charts  `pip install 'crossdc[charts]'`: one extra; a chart is drawn (a drill's timeline
#           with it: `dr drill` runs without it too, its report then says the picture is not
#           drawn), while `dr reconcile` still asks for its own.
#
#   .ci/clean-venv.sh            (CLEAN_VENV_DIR=/some/dir to keep and reuse the venvs)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
base="${CLEAN_VENV_DIR:-$(mktemp -d -t crossdc-clean-XXXXXX)}"
work="$(mktemp -d -t crossdc-user-XXXXXX)"   # the user's folder: no policies/, no checkout
started=$SECONDS

venv() {  # venv NAME: a fresh venv with an up-to-date pip
  local dir="$base/$1"
  if [[ ! -x "$dir/bin/python" ]]; then
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip
  fi
}

# -- the wheels, built from the sources alone -------------------------------------------
venv lean
shopt -s nullglob
wheels=("$base"/dist/crossdc-[0-9]*.whl)
client_wheels=("$base"/dist/crossdc_client-*.whl)
if [[ ${#wheels[@]} -eq 0 || ${#client_wheels[@]} -eq 0 ]]; then
  src="$base/src"
  rm -rf "$src" && mkdir -p "$src"
  if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) \
      | tar -x -C "$src"
  else
    cp -a "$repo/." "$src" && rm -rf "$src/.venv"
  fi
  rm -rf "$src/client/src/crossdc_client/_proto" "$src/proxy/_proto"
  "$base/lean/bin/pip" wheel -q --no-deps -w "$base/dist" "$src/client"
  "$base/lean/bin/pip" wheel -q --no-deps -w "$base/dist" "$src"
  wheels=("$base"/dist/crossdc-[0-9]*.whl)
  client_wheels=("$base"/dist/crossdc_client-*.whl)
fi
wheel="${wheels[0]}"
client_wheel="${client_wheels[0]}"
echo "clean-venv: built $(basename "$client_wheel") and $(basename "$wheel")" \
  "($((SECONDS - started)) s)"

# -- the lean install ------------------------------------------------------------------
if [[ ! -x "$base/lean/bin/dr" ]]; then
  # crossdc-client is not on PyPI: given beside crossdc, pip takes it for the dependency
  "$base/lean/bin/pip" install -q "$client_wheel" "$wheel"
fi
echo "clean-venv: lean install ready ($((SECONDS - started)) s, $("$base/lean/bin/pip" list \
  --format=freeze 2>/dev/null | wc -l) distributions)"

failed=0
# only_runtime VENV EXTRA_MODULES...: the venv holds none of these modules
absent() {
  local py="$1"; shift
  local found
  found="$("$py" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))' "$@")"
  if [[ -n "$found" ]]; then
    echo "FAIL: $py has $found; it must not"; failed=1
  else
    echo "ok   no $*"
  fi
}
absent "$base/lean/bin/python" pyspark matplotlib testcontainers docker grpc_tools pytest dns

cd "$work"
cp "$repo/policies/topology.local.yaml" "$work/topology.yaml"
cp "$repo/policies/default.yaml" "$work/policy.yaml"
mkfifo "$work/pipe.yaml"
ln -s /dev/zero "$work/zero.yaml"
unset CROSSDC_TOPOLOGY
export CROSSDC_STATE_DIR="$work/state" CROSSDC_CACHE_DIR="$work/cache" COLUMNS=200
export PATH="$base/lean/bin:$PATH"

# check CODE LINES [SAYS] -- command...: exit status CODE, no traceback anywhere, (LINES > 0)
# exactly LINES non-empty lines on stderr, and (SAYS given) SAYS on stderr.
check() {
  local want="$1" lines="$2" says=""
  shift 2
  if [[ "$1" != "--" ]]; then says="$1"; shift; fi
  shift
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
  elif [[ -n "$says" ]] && ! grep -qF -- "$says" "$err"; then
    echo "FAIL (does not say \"$says\"): $*"; cat "$err"; failed=1
  else
    echo "ok   (exit $code): $*"
    if [[ "$lines" -gt 0 ]]; then sed 's/^/       /' "$err"; fi
  fi
  rm -f "$out" "$err"
}

# runs
check 0 0 -- dr --help
check 0 0 -- dr proxy serve --help
check 0 0 -- python -m dr.reconcile --help
check 0 0 -- dr topology validate topology.yaml
check 0 0 -- dr policy validate policy.yaml -t topology.yaml
check 0 0 -- python -c "import proxy.api, proxy.server; from proxy.build_protos import is_fresh; assert is_fresh()"
# aiokafka's snappy, lz4 and zstd codecs come with the runtime set (cramjam), not an extra
check 0 0 -- python -c "from aiokafka.codec import has_lz4, has_snappy, has_zstd
assert has_lz4() and has_snappy() and has_zstd(), 'no cramjam: compressed topics unreadable'"
# bad input: one line, exit 2 (the command line) or 65 (a file refused: dr/exits.py)
check 2 1 -- dr status --bogus
check 65 1 -- dr topology validate /nonexistent
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
check 65 1 -- dr drill --scenario primary-outage -t topology.yaml --config /nonexistent
check 1 1 -- dr drill --scenario primary-outage -t topology.yaml --dry-run
check 2 1 -- dr demo -t topology.yaml
check 2 1 -- dr prometheus config --target bad
# numbers out of range, words that are not a choice (issue 22)
check 2 1 "'--port'" -- dr proxy serve --region east -p policy.yaml -t topology.yaml --port 70000
check 2 1 "'--metrics-port'" -- dr proxy serve --region east -p policy.yaml --metrics-port 99999
check 2 1 "'--metrics-port'" -- dr mirror run --metrics-port 70000
check 2 1 "'--grace'" -- dr proxy serve --region east -p policy.yaml --grace nan
check 2 1 "'--log-level'" -- dr --log-level loud status
# hostile files: a named pipe, /dev/zero behind a link (refused at once, never read)
check 65 1 "named pipe" -- dr policy validate pipe.yaml
check 65 1 "named pipe" -- dr topology validate pipe.yaml
check 65 1 "character device" -- dr policy validate zero.yaml
check 65 1 "named pipe" -- dr proxy serve --region east -p pipe.yaml -t topology.yaml
# commands that need an extra say which one
check 1 1 "pip install 'crossdc[reconcile]'" -- \
  dr reconcile --regions east,west --topics x -t topology.yaml
check 1 1 "pip install 'crossdc[reconcile]'" -- \
  python -m dr.reconcile --regions east,west --topics x -t topology.yaml
# a drill needs no plotting library (its picture does): it gets past every extras check and
# fails reaching the (absent) stack, in one line
check 1 1 "no proxy known" -- dr drill --scenario primary-outage -t topology.yaml
check 1 1 "pip install 'crossdc[demo]'" -- dr demo -t topology.yaml -p policy.yaml
check 1 1 "pip install 'crossdc[charts]'" -- \
  python -c "from pathlib import Path; from dr.exits import run_app; import typer
app = typer.Typer()
@app.command()
def draw() -> None:
    from dr.charts import lines
    lines(Path('c.png'), series={'a': [(0, 1), (1, 2)]}, title='t', xlabel='x', ylabel='y')
run_app(app)"

# -- one extra: charts -----------------------------------------------------------------
venv charts
if ! "$base/charts/bin/python" -c "import matplotlib" 2>/dev/null; then
  "$base/charts/bin/pip" install -q "$client_wheel" "$wheel[charts]"
fi
echo "clean-venv: charts install ready ($((SECONDS - started)) s)"
export PATH="$base/charts/bin:${PATH#"$base/lean/bin:"}"
absent "$base/charts/bin/python" pyspark testcontainers grpc_tools pytest
check 0 0 -- python -c "from pathlib import Path; from dr.charts import lines
p = lines(Path('c.png'), series={'a': [(0, 1), (1, 2)]}, title='t', xlabel='x', ylabel='y')
assert p.read_bytes()[:4] == b'\x89PNG'"
check 1 1 "pip install 'crossdc[reconcile]'" -- \
  dr reconcile --regions east,west --topics x -t topology.yaml
check 2 1 -- dr drill --scenario primary-outage -t topology.yaml --max-rto-s -1
# past the extra's check: the drill now fails reaching the (absent) stack, not for matplotlib
out="$(timeout 120 dr drill --scenario primary-outage -t topology.yaml 2>&1 || true)"
if grep -q "pip install" <<<"$out" || grep -q Traceback <<<"$out"; then
  echo "FAIL: dr drill with the charts extra: $out"; failed=1
else
  echo "ok   dr drill with charts gets past the extras check: ${out%%$'\n'*}"
fi

# -- the client distribution alone: what an application installs -----------------------
venv client
if ! "$base/client/bin/python" -c "import crossdc_client" 2>/dev/null; then
  "$base/client/bin/pip" install -q "$client_wheel"
fi
echo "clean-venv: client install ready ($((SECONDS - started)) s, $("$base/client/bin/pip" \
  list --format=freeze 2>/dev/null | wc -l) distributions:" \
  "$("$base/client/bin/pip" list --format=freeze 2>/dev/null | cut -d= -f1 | tr '\n' ' '))"
export PATH="$base/client/bin:${PATH#"$base/charts/bin:"}"
absent "$base/client/bin/python" aiokafka confluent_kafka consul aiohttp typer rich \
  cryptography
absent "$base/client/bin/python" pydantic yaml structlog tenacity crossdc proxy dr mirror \
  grpc_tools
check 0 0 -- python -c "import crossdc_client.api, crossdc_client.build_protos as b
from crossdc_client import AsyncConsumer, AsyncProducer, Producer, ProduceFailed, Closed
assert b.is_fresh() and not b.in_checkout(), 'stubs from the build, an installed package'"
# a stopped client is one error of the SDK's tree, the same class the full install catches
check 0 0 -- python -c "import asyncio
from crossdc_client import AsyncProducer, Closed, CrossdcError
async def main():
    p = AsyncProducer('127.0.0.1:1')
    await p.start(); await p.stop()
    try:
        await p.send('t', b'v')
    except Closed as exc:
        assert isinstance(exc, CrossdcError)
    else:
        raise SystemExit('send after stop did not raise Closed')
asyncio.run(main())"
# the SDK against a real proxy: the stack and the proxy from the dev venv, the application
# in this venv
if [[ ! -x "$repo/.venv/bin/pytest" ]]; then
  echo "FAIL: no dev venv at $repo/.venv (make setup) to run the proxy for the client"; failed=1
elif (cd "$repo" && CROSSDC_CLIENT_PYTHON="$base/client/bin/python" timeout 600 \
      .venv/bin/pytest -n 0 -q -p no:cacheprovider tests/integration/test_client_install.py \
      >"$work/client-test.log" 2>&1); then
  echo "ok   the client alone produces and consumes through a real proxy" \
    "($(grep -Eo '[0-9]+ passed in [0-9.]+s' "$work/client-test.log" | tail -1))"
else
  echo "FAIL: tests/integration/test_client_install.py with the client venv:"
  tail -40 "$work/client-test.log"; failed=1
fi

rm -rf "$work"
[[ -n "${CLEAN_VENV_DIR:-}" ]] || rm -rf "$base"
if [[ "$failed" != 0 ]]; then echo "clean-venv: FAILED ($((SECONDS - started)) s)"; exit 1; fi
echo "clean-venv: lean install and the charts extra: every error path one line, no traceback;" \
  "the client alone: no daemon library, a record produced and consumed ($((SECONDS - started)) s)"
