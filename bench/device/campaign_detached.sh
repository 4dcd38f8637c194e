#!/bin/bash
# On the GPU machine: `autotune run CAMPAIGN` detached from the call (setsid, from a copy of the tree
# in /tmp/xrepo, so that the next call's copy of the working tree cannot change it mid-run), then
# waits up to WAIT_S seconds (default 540) and copies the log and the run directories (as
# runs.tgz: the device gives back files at most 16 folders deep) to $OUT/xout.
# Called again with the same campaign once started, it never starts it again: it waits and copies,
# or says the run died without an exit status. A campaign longer than one call's 10 minutes spans
# calls, the machine kept warm by calling again at once.
#   bash .dev/setup.sh && PYTHONPATH=/tmp/site bash bench/device/campaign_detached.sh campaigns/h200_single.yaml
# PYTHONPATH: the kits' folders (this script appends the copy of the tree).
set -euo pipefail
campaign=${1:?usage: campaign_detached.sh CAMPAIGN_YAML}
work=/tmp/xout
mkdir -p "$work"
if [ ! -f "$work/started" ]; then
  date -u +%FT%TZ > "$work/started"
  rm -rf /tmp/xrepo && cp -r . /tmp/xrepo
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$work/gpu.csv" || true
  # The pid is written by the detached shell itself: under a caller's job control, setsid forks
  # and the pid of the command it was given is gone at once.
  (cd /tmp/xrepo && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/xrepo" PYTHONUNBUFFERED=1 \
     setsid bash -c "echo \$\$ > '$work/pid'; python3 -m autotune run '$campaign' > '$work/campaign.log' 2>&1; echo \$? > '$work/rc'" \
     < /dev/null > /dev/null 2>&1 &)
  echo "started $campaign at $(cat "$work/started")"
fi
deadline=$((SECONDS + ${WAIT_S:-540}))
while [ ! -f "$work/rc" ] && [ "$SECONDS" -lt "$deadline" ]; do
  sleep 5
  if [ -f "$work/pid" ] && ! kill -0 "$(cat "$work/pid")" 2>/dev/null && [ ! -f "$work/rc" ]; then
    echo "the campaign's process is gone without an exit status"; break
  fi
done
mkdir -p "$OUT/xout"
cp "$work"/* "$OUT/xout/"
[ -d /tmp/xrepo/runs ] && tar czf "$OUT/xout/runs.tgz" -C /tmp/xrepo runs
if [ -f "$work/rc" ]; then echo "finished: rc $(cat "$work/rc")"; else echo "not finished at $(date -u +%FT%TZ)"; fi
grep -aE "screen |promote |spent|winner" "$work/campaign.log" | tail -25 || true
