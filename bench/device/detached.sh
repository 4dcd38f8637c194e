#!/bin/bash
# On the GPU machine: a command that outlasts one device call (10 minutes at most; the machine goes
# back 30 s after a call), e.g. `python3 -m autotune run CAMPAIGN` or `bash bench/bridge_campaign_gpu.sh
# /tmp/xout/bridge`. The first call starts it detached (setsid) from a copy of the tree in /tmp/xrepo,
# so that the next call's copy of the working tree cannot change it mid-run; every call waits up to
# WAIT_S seconds (default 540), then copies to $OUT/xout the files atop /tmp/xout (the command's log
# and exit status) and all.tgz: /tmp/xout with what the command wrote there, and /tmp/xrepo/runs
# (the device gives back files at most 16 folders deep), their files under 4 MiB: a generated
# checkpoint or dataset there made the archive too large to come back. Once started, it is never started again: a
# later call waits and copies, or says the command died without an exit status. Call again at once
# to keep the machine.
#   bash .dev/setup.sh && PYTHONPATH=/tmp/site bash bench/device/detached.sh python3 -m autotune run campaigns/h200_single.yaml
# PYTHONPATH: the kits' folders (the copy of the tree is appended).
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: detached.sh COMMAND [ARG...]"; exit 2; }
work=/tmp/xout
mkdir -p "$work"
if [ ! -f "$work/started" ]; then
  printf '%s %s\n' "$(date -u +%FT%TZ)" "$*" > "$work/started"
  rm -rf /tmp/xrepo && cp -r . /tmp/xrepo
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$work/gpu.csv" || true
  printf '%q ' "$@" > "$work/command"
  # The pid is written by the detached shell itself: under a caller's job control, setsid forks
  # and the pid of the command it was given is gone at once.
  (cd /tmp/xrepo && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/xrepo" PYTHONUNBUFFERED=1 \
     setsid bash -c "echo \$\$ > '$work/pid'; $(cat "$work/command") > '$work/command.log' 2>&1; echo \$? > '$work/rc'" \
     < /dev/null > /dev/null 2>&1 &)
  echo "started: $(cat "$work/started")"
fi
deadline=$((SECONDS + ${WAIT_S:-540}))
while [ ! -f "$work/rc" ] && [ "$SECONDS" -lt "$deadline" ]; do
  sleep 5
  if [ -f "$work/pid" ] && ! kill -0 "$(cat "$work/pid")" 2>/dev/null && [ ! -f "$work/rc" ]; then
    echo "the command's process is gone without an exit status"; break
  fi
done
mkdir -p "$OUT/xout"
find "$work" -maxdepth 1 -type f -exec cp {} "$OUT/xout/" \;
# Files of 4 MiB or more stay behind (a checkpoint, prepared data): the device gives back less.
(cd / && find tmp/xout tmp/xrepo/runs -type f -size -4M -print0 2>/dev/null || true) \
  | tar czf "$OUT/xout/all.tgz" -C / --null -T -
if [ -f "$work/rc" ]; then echo "finished: rc $(cat "$work/rc")"; else echo "not finished at $(date -u +%FT%TZ)"; fi
grep -aE "screen |promote |spent|winner" "$work/command.log" | tail -25 || true
