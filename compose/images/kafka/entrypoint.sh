#!/bin/bash
# crossdc/kafka's entry point: `server` (default) writes server.properties from the KAFKA_*
# variables, formats the storage once, and runs the node; `health` checks that the first
# advertised listener accepts connections (the image's HEALTHCHECK).
set -euo pipefail
conf=/var/lib/kafka/server.properties
data=/var/lib/kafka/data
cp=(-cp "/opt/kafka/libs/*")
log4j=-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.yaml

case "${1:-server}" in
  health)
    first="${KAFKA_ADVERTISED_LISTENERS%%,*}"   # NAME://host:port
    hostport="${first#*://}"
    exec timeout 2 bash -c "exec 3<>/dev/tcp/${hostport%:*}/${hostport##*:}" ;;
  server) ;;
  *) exec "$@" ;;
esac

: "${CLUSTER_ID:?CLUSTER_ID is unset: the id every node of the cluster is formatted with}"
{
  for var in $(compgen -e); do
    case "$var" in
      KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_OPTS|KAFKA_LOG_DIRS) continue ;;
      KAFKA_*) ;;
      *) continue ;;
    esac
    key=$(printf '%s' "${var#KAFKA_}" | tr 'A-Z' 'a-z' \
          | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
    printf '%s=%s\n' "$key" "${!var}"
  done
  printf 'log.dirs=%s\n' "$data"
} > "$conf"

if [ ! -f "$data/meta.properties" ]; then
  java -Xmx256m "$log4j" "${cp[@]}" kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$conf"
fi
# shellcheck disable=SC2086  # the heap options are several words
exec java $KAFKA_HEAP_OPTS ${KAFKA_OPTS:-} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
  -Djava.awt.headless=true "$log4j" "${cp[@]}" kafka.Kafka "$conf"
