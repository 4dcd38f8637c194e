#!/usr/bin/env bash
# Start (or stop) a single-node Ray head on loopback: the head a laptop or CI box uses for
# `ray job submit`. Nothing binds beyond 127.0.0.1 that Ray lets us bind there, and Ray's token
# authentication stays on (the token lives in ~/.ray/auth_token; clients send it when
# RAY_AUTH_MODE=token is set).
#   cluster/local_head.sh start [NUM_CPUS]    cluster/local_head.sh stop
# Its ports and its folder can be moved, e.g. to run two heads, or one beside a test suite's:
#   LOCAL_HEAD_PORT (GCS, 6379)  LOCAL_HEAD_DASHBOARD_PORT (dashboard and job API, 8265)
#   LOCAL_HEAD_CLIENT_PORT (Ray Client, 10001)  LOCAL_HEAD_AGENT_PORT (the node's agent, 52365)
#   LOCAL_HEAD_DIR (its sessions and sockets, /tmp/ray-loopback; keep it short: Ray's socket paths
#   must fit in 107 bytes)
# `stop` stops this head's processes only: `ray stop` would kill every Ray process on the machine,
# an embedded campaign's local cluster included.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Jobs inherit the head's PATH: put this checkout's environment first so `python` is the one
# that has autotune and its dependencies.
[ -d "$root/.venv/bin" ] && export PATH="$root/.venv/bin:$PATH"
port=${LOCAL_HEAD_PORT:-6379}
dashboard_port=${LOCAL_HEAD_DASHBOARD_PORT:-8265}
folder=${LOCAL_HEAD_DIR:-/tmp/ray-loopback}
case "${1:-start}" in
  start)
    # Token authentication on: create ~/.ray/auth_token once, start the head in token mode.
    ray get-auth-token --generate >/dev/null
    RAY_AUTH_MODE=token ray start --head --node-ip-address=127.0.0.1 --port="$port" --temp-dir="$folder" \
      --dashboard-host=127.0.0.1 --dashboard-port="$dashboard_port" \
      --ray-client-server-port="${LOCAL_HEAD_CLIENT_PORT:-10001}" \
      --dashboard-agent-listen-port="${LOCAL_HEAD_AGENT_PORT:-52365}" \
      --num-cpus="${2:-$(nproc)}" --disable-usage-stats
    echo "submit with: RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:$dashboard_port ray job submit --working-dir . -- <command>"
    ;;
  stop)
    # This head's processes name its folder on their command line (GCS, raylet, dashboard, log
    # monitor), or its GCS port (the Ray Client server); the rest (workers, agents, the dashboard's
    # modules) descend from those. TERM, then KILL what is left after 10 s.
    python3 - "$folder" "$port" <<'PY'
import sys
import psutil
folder, port = sys.argv[1].rstrip("/") + "/", sys.argv[2]
def ours(process: psutil.Process) -> bool:
    line = process.cmdline()
    return any(folder in arg for arg in line) or (
        "ray.util.client.server" in line and any(arg.startswith("--address=") and arg.endswith(f":{port}") for arg in line))
roots = []
for process in psutil.process_iter():
    try:
        if ours(process):
            roots.append(process)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass
victims = {process.pid: process for root in roots for process in [root, *root.children(recursive=True)]}
for process in victims.values():
    try:
        process.terminate()
    except psutil.NoSuchProcess:
        pass
_, alive = psutil.wait_procs(list(victims.values()), timeout=10)
for process in alive:
    process.kill()
print(f"stopped the head in {folder}: {len(victims)} processes" if victims else f"no head runs in {folder}")
PY
    ;;
  *)
    echo "usage: $0 start [NUM_CPUS] | stop" >&2
    exit 2
    ;;
esac
