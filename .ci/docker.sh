#!/usr/bin/env bash
# CI: the compose deployment as a new user meets it (docs/docker.md). Needs the engine and the
# images (`make images`, which .ci/run runs before `make test-more`). Brings the whole story up
# in containers (`dr up --docker`: Docker Compose v2, built from its Go module on first use and
# cached), runs a primary-outage drill against it through the drill file's docker hooks (a
# breach fails CI), then `dr down` and checks that no container of the deployment is left.
# Then the partition drill (`--scenario partition`: the primary's datacenter off the `wan`
# network; policies/drill.docker-partition.yaml, whose limits are sized for a partition).
set -euo pipefail
cd "$(dirname "$0")/.."
dr="${CROSSDC_DR:-.venv/bin/dr}"   # the dr to run (another venv's: CROSSDC_DR=/path/to/dr)
state="$(mktemp -d -t crossdc-docker-XXXXXX)"
reports="$state/reports"
cleanup() { "$dr" down --state-dir "$state" >/dev/null 2>&1 || true; }
trap cleanup EXIT
start=$SECONDS
"$dr" up --docker --state-dir "$state"
echo "docker.sh: the deployment was up and healthy after $((SECONDS - start)) s"
"$dr" status --topology policies/topology.docker.yaml >/dev/null
"$dr" drill --scenario primary-outage --topology policies/topology.docker.yaml \
  --config policies/drill.docker.yaml --reports "$reports"
"$dr" drill --scenario partition --topology policies/topology.docker.yaml \
  --config policies/drill.docker-partition.yaml --reports "$reports"
"$dr" down --state-dir "$state"
left="$(docker ps -aq --filter label=com.docker.compose.project=crossdc)"
if [ -n "$left" ]; then
  echo "docker.sh: containers left after dr down: $left" >&2
  exit 1
fi
echo "docker.sh: nothing left running; the whole check took $((SECONDS - start)) s"
