#!/bin/bash
# On the GPU machine (TE and .dev kits installed): where a megatron trial's device-seconds outside its
# training steps go. Runs campaigns/h200_te.yaml cut to a few trials (its space, workload, cap and warm
# rank zygotes as committed; one promotion run), then prints its report, whose "medians:" and
# "build, medians:" lines split the median trial's seconds (Tune's start, the rank's, the build part by
# part, between and after the steps). Each trial's split is in OUT/run/trials.jsonl (outside_steps).
#   bash .dev/setup.sh && PYTHONPATH=/tmp/te-site:/tmp/site bash bench/device/detached.sh \
#     bash bench/outside_steps_gpu.sh /tmp/xout/split
set -euo pipefail
out=${1:?usage: outside_steps_gpu.sh OUT [MAX_TRIALS]}
trials=${2:-8}
mkdir -p "$out"
sed -e "s/^  max_trials: .*/  max_trials: $trials/" -e "s/^  promote_top_k: .*/  promote_top_k: 1/" \
    -e "s/^  promote_repeats: .*/  promote_repeats: 1/" -e "s#^output_dir: .*#output_dir: $out/run#" \
    "${CAMPAIGN:-campaigns/h200_te.yaml}" > "$out/campaign.yaml"
python3 -m autotune run "$out/campaign.yaml" 2>&1 | tee "$out/campaign.log"
python3 -m autotune report "$out"/run/* 2>&1 | tee "$out/report.txt"
# Ranks the node's zygote ended because their GPU had been given to another trial (trainables/zygote.py).
grep -rh "still holds GPU" /tmp/ray/session_latest/logs > "$out/ended_ranks.log" 2>/dev/null || true
# A rank kept across trials recompiles megatron-core's fused functions for each new shape; past
# torch._dynamo's recompile limit it would run them eager, slower than a new process would.
grep -rh -A2 "hit config.recompile_limit" /tmp/ray/session_latest/logs > "$out/recompile_limit.log" 2>/dev/null || true
