#!/usr/bin/env bash
# A network partition of the compose deployment (docs/docker.md): cut a datacenter's containers
# off the network that joins the datacenters, or join them again.
#
#   bash compose/docker/partition.sh cut east      # east's Kafka, Consul, proxy, controller
#                                                  # and the mirror into east: off `wan`
#   bash compose/docker/partition.sh heal east     # back on `wan`, at the same addresses
#   bash compose/docker/partition.sh show          # which container is on which network
#
# The containers keep their datacenter's own network: they still reach each other, and the
# host (and clients on it) still reaches them, as clients inside a cut-off datacenter would.
# Every other datacenter loses them. Each container carries its datacenter
# (io.crossdc.datacenter) and its `wan` address (io.crossdc.wan-address) as labels, so `heal`
# puts it back at the address the other datacenters' topology views name.
# CROSSDC_COMPOSE_PROJECT: the compose project (default crossdc).
set -euo pipefail
project="${CROSSDC_COMPOSE_PROJECT:-crossdc}"
wan="${project}_wan"
action="${1:-}"
dc="${2:-}"

containers() {  # name and wan address of every container of datacenter $1
  docker ps -a --filter "label=com.docker.compose.project=$project" \
    --filter "label=io.crossdc.datacenter=$1" \
    --format '{{.Names}} {{.Label "io.crossdc.wan-address"}}'
}

on_wan() {  # whether container $1 is attached to the wan network now
  docker inspect --format "{{if index .NetworkSettings.Networks \"$wan\"}}yes{{end}}" "$1" \
    | grep -q yes
}

case "$action" in
  cut|heal)
    [ -n "$dc" ] || { echo "usage: $0 $action DATACENTER" >&2; exit 2; }
    found=0
    while read -r name address; do
      [ -n "$name" ] || continue
      found=1
      if [ "$action" = cut ]; then
        if on_wan "$name"; then docker network disconnect -f "$wan" "$name"; fi
      else
        if ! on_wan "$name"; then docker network connect --ip "$address" "$wan" "$name"; fi
      fi
      echo "partition.sh: $action $dc: $name"
    done < <(containers "$dc")
    if [ "$found" = 0 ]; then
      echo "partition.sh: no container of datacenter $dc in project $project" >&2
      exit 1
    fi ;;
  show)
    docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}}' \
      | sort | while read -r name; do
        printf '%-32s %s\n' "$name" "$(docker inspect --format \
          '{{range $n, $e := .NetworkSettings.Networks}}{{$n}}={{$e.IPAddress}} {{end}}' "$name")"
      done ;;
  *) echo "usage: $0 cut|heal DATACENTER | show" >&2; exit 2 ;;
esac
