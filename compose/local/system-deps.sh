#!/usr/bin/env bash
# Debian packages the tests and runbooks use besides Java, Maven and Go (preinstalled):
# kcat (Kafka metadata from outside Python), dig (Consul DNS), prometheus (the server the demo
# runs, and promtool, which checks observability/alerts.yml), chromium (a headless
# browser) and faketime (libfaketime: the nemesis's clock skew of one daemon). Installed when missing and we are root with apt-get; otherwise say what is
# missing and go on (those tests skip).
set -euo pipefail
missing=()
command -v kcat >/dev/null 2>&1 || missing+=(kcat)
command -v dig >/dev/null 2>&1 || missing+=(dnsutils)
command -v ss >/dev/null 2>&1 || missing+=(iproute2)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} (apt-get)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "note: ${missing[*]} not installed; the tests that use them will be skipped" >&2
fi
