#!/usr/bin/env bash
# Start (or stop) a single-node Ray cluster on loopback: the head a laptop or CI box uses for
# `ray job submit`. Nothing binds beyond 127.0.0.1, and Ray's token authentication stays on
# (the token lives in ~/.ray/auth_token; clients send it when RAY_AUTH_MODE=token is set).
#   cluster/local_head.sh start [NUM_CPUS]    cluster/local_head.sh stop
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Jobs inherit the head's PATH: put this checkout's environment first so `python` is the one
# that has autotune and its dependencies.
[ -d "$root/.venv/bin" ] && export PATH="$root/.venv/bin:$PATH"
ray=ray
case "${1:-start}" in
  start)
    # Token authentication on: create ~/.ray/auth_token once, start the head in token mode.
    "$ray" get-auth-token --generate >/dev/null
    RAY_AUTH_MODE=token "$ray" start --head --node-ip-address=127.0.0.1 --port=6379 \
      --dashboard-host=127.0.0.1 --dashboard-port=8265 --num-cpus="${2:-$(nproc)}" --disable-usage-stats
    echo "submit with: RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- <command>"
    ;;
  stop)
    "$ray" stop --force
    ;;
  *)
    echo "usage: $0 start [NUM_CPUS] | stop" >&2
    exit 2
    ;;
esac
