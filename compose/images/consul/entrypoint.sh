#!/bin/bash
# crossdc/consul's entry point: `agent [FLAGS]` runs the agent on /consul/config (with
# $CONSUL_LOCAL_CONFIG written there first); anything else is a consul subcommand.
set -euo pipefail
if [ -n "${CONSUL_LOCAL_CONFIG:-}" ]; then
  printf '%s' "$CONSUL_LOCAL_CONFIG" > /consul/config/local.json
fi
if [ "${1:-agent}" = agent ]; then
  shift || true
  exec consul agent -config-dir=/consul/config "$@"
fi
exec consul "$@"
