#!/bin/bash
# On the GPU machine: `autotune run CAMPAIGN` detached from the call (setsid, from a copy of the tree
# in /tmp/xrepo, so that the next call's copy of the working tree cannot change it mid-run), then
# waits up to WAIT_S seconds (default 540) and copies the log and the run directories to $OUT.
# Called again with the same campaign while it runs, it only waits and copies: a campaign longer
# than one call's 10 minutes spans calls, the machine kept warm by calling again at once.
#   bash .dev/setup.sh && PYTHONPATH=/tmp/site bash bench/device/campaign_detached.sh campaigns/h200_single.yaml
# PYTHONPATH: the kits' folders (this script appends the copy of the tree).
set -euo pipefail
campaign=${1:?usage: campaign_detached.sh CAMPAIGN_YAML}
work=/tmp/xout
mkdir -p "$work"
if ! { [ -f "$work/pid" ] && kill -0 "$(cat "$work/pid")" 2>/dev/null; } && [ ! -f "$work/rc" ]; then
  rm -rf /tmp/xrepo && cp -r . /tmp/xrepo
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$work/gpu.csv" || true
  (cd /tmp/xrepo && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/xrepo" PYTHONUNBUFFERED=1 \
     setsid bash -c "python3 -m autotune run '$campaign' > '$work/campaign.log' 2>&1; echo \$? > '$work/rc'" \
     < /dev/null > /dev/null 2>&1 & echo $! > "$work/pid")
  echo "started $campaign at $(date -u +%FT%TZ)"
fi
deadline=$((SECONDS + ${WAIT_S:-540}))
while [ ! -f "$work/rc" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
mkdir -p "$OUT/xout"
cp -r "$work/." "$OUT/xout/"
[ -d /tmp/xrepo/runs ] && cp -r /tmp/xrepo/runs "$OUT/xout/"
if [ -f "$work/rc" ]; then echo "finished: rc $(cat "$work/rc")"; else echo "still running at $(date -u +%FT%TZ)"; fi
grep -aE "screen |promote |spent|winner" "$work/campaign.log" | tail -25 || true
