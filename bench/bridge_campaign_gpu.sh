#!/bin/bash
# The `bridge` campaign end to end on one GPU, then the paste-back check of its winner, in one go:
#   bash bench/bridge_campaign_gpu.sh OUT_DIR      (PASTE_BACK_REPEATS=0: the campaign alone)
# Makes the proxy checkpoint and the Energon dataset where campaigns/h200_bridge.yaml expects them,
# runs `autotune run` on it (Ray Tune trials of Bridge's pretrain()), exports the winner, writes the
# report, then pastes the export into a plain Bridge launch of 50 steps (bench/bridge_paste_back.py).
# Needs Bridge 0.6.2, megatron-core 0.19.2, TE, Ray and Optuna on PYTHONPATH (bench/README.md).
set -euo pipefail
out=${1:?usage: bridge_campaign_gpu.sh OUT_DIR}
mkdir -p "$out"
stage() { echo "$(date -u +%FT%TZ) $*" >> "$out/stages.log"; }
stage data
python3 -m autotune data hf-proxy runs/hf-proxy --shape h200 > "$out/data.log" 2>&1
[ -f runs/energon/.nv-meta/dataset.yaml ] || python3 -m autotune data build --energon runs/energon >> "$out/data.log" 2>&1
stage campaign
python3 -m autotune run campaigns/h200_bridge.yaml > "$out/campaign_stdout.log" 2>&1 || echo "autotune run exited $?" >> "$out/campaign_stdout.log"
run_dir=$(ls -d runs/h200-bridge/h200-bridge-* | tail -1)
python3 -m autotune export "$run_dir" --format bridge > "$out/winner_bridge.txt" 2>&1 || true
python3 -m autotune report "$run_dir" > "$out/report.log" 2>&1 || true
cp -r "$run_dir" "$out/campaign"
repeats=${PASTE_BACK_REPEATS:-1}   # 0: no paste-back here (run it later on the committed run directory)
if [ "$repeats" -gt 0 ]; then
  stage paste-back
  python3 bench/bridge_paste_back.py "$run_dir" --steps 50 --repeats "$repeats" --out "$out/paste_back.json" > "$out/paste_back.log" 2>&1
fi
stage finished
echo finished > "$out/DONE"
