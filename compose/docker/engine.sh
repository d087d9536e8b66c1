#!/usr/bin/env bash
# A Docker engine for crossdc's images, its compose deployment and the container tests.
#
#   bash compose/docker/engine.sh          # install (apt-get), start, wait; idempotent
#
# Installs Debian's docker.io (dockerd, containerd, runc), iptables and debootstrap when missing,
# starts `dockerd` as root when no engine answers at $DOCKER_HOST (default
# unix:///var/run/docker.sock), and waits until the engine answers (`docker info`: the engine
# itself, never the mere presence of the client).
#
# The engine starts with --iptables=false: by default dockerd sets the iptables FORWARD
# policy to DROP, and this machine's kernel passes bridged frames through iptables
# (bridge-nf-call-iptables=1), which silently cuts the bridge between the network namespaces
# of the partition suite (dr/stack/netns.py, bridge `cdc<tag>`). Without its iptables rules
# the engine does no NAT: containers reach the registries with host networking
# (`docker build --network host`), and containers of one Docker network reach each other and
# the host over their bridge. Should an engine started by someone else have set the policy to
# DROP, an explicit ACCEPT rule for the project's bridges (`cdc+`) is added (once).
set -euo pipefail

host="${DOCKER_HOST:-unix:///var/run/docker.sock}"
case "$host" in
  unix://*) sock="${host#unix://}" ;;
  *) echo "engine.sh: DOCKER_HOST=$host: only a local unix socket can be started here" >&2
     exit 2 ;;
esac
log="${CROSSDC_DOCKERD_LOG:-/var/log/crossdc-dockerd.log}"
timeout_s="${CROSSDC_DOCKERD_TIMEOUT_S:-60}"

answers() { docker -H "$host" info --format '{{.ServerVersion}}' >/dev/null 2>&1; }

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "engine.sh: ${need[*]} missing and not root with apt-get: install them, then re-run" >&2
    exit 1
  fi
  echo "engine.sh: installing ${need[*]} (apt-get)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
    >/dev/null
fi

if ! answers; then
  if [ "$(id -u)" != 0 ]; then
    echo "engine.sh: no Docker engine answers at $host, and starting dockerd needs root" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$sock")" "$(dirname "$log")"
  pidfile="$(dirname "$sock")/crossdc-dockerd.pid"
  echo "engine.sh: starting dockerd at $host (--iptables=false; log $log)"
  # setsid: the engine outlives this shell and its job control
  setsid dockerd -H "$host" --iptables=false --ip-masq=false --pidfile "$pidfile" \
    >>"$log" 2>&1 < /dev/null &
  deadline=$((SECONDS + timeout_s))
  until answers; do
    if ! kill -0 $! 2>/dev/null; then
      echo "engine.sh: dockerd exited; last lines of $log:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "engine.sh: dockerd (pid $!) did not answer at $host within ${timeout_s}s; see $log" >&2
      exit 1
    fi
    sleep 0.5  # the engine's socket comes up on its own; polled, not waited out
  done
fi

# The partition suite's bridges must forward: refuse to leave a DROP policy that cuts them.
if command -v iptables >/dev/null 2>&1 && iptables -S FORWARD >/dev/null 2>&1; then
  if iptables -S FORWARD | grep -qx -- '-P FORWARD DROP'; then
    if ! iptables -C FORWARD -i cdc+ -o cdc+ -j ACCEPT 2>/dev/null; then
      iptables -I FORWARD 1 -i cdc+ -o cdc+ -j ACCEPT
      echo "engine.sh: FORWARD policy is DROP (an engine with iptables rules): added" \
           "ACCEPT for the partition suite's bridges (cdc+)"
    fi
  fi
fi
echo "engine.sh: Docker $(docker -H "$host" info --format '{{.ServerVersion}}') answers at $host"
