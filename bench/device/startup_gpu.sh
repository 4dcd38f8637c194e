#!/bin/bash
# On the GPU machine (TE and .dev kits installed), in one detached run: what a trial's start-up is made
# of. First what a rank process kept across trials saves (bench/reused_process.py with
# TORCHDYNAMO_DISABLE=1, after a new process's reference run), then a short campaign whose report
# splits each trial's seconds outside its steps, its build and its end part by part, and its first
# step's warm-up, trial by trial with how its ranks started (bench/outside_steps_gpu.sh), then the
# reused process again with megatron-core's torch.compile fusions on (last: the campaign's figures
# come back first). CAMPAIGN picks the
# campaign (campaigns/h100_te.yaml on an H100), TRIALS its number of trials (8).
#   bash .dev/setup.sh && CAMPAIGN=campaigns/h100_te.yaml PYTHONPATH=/tmp/te-site:/tmp/site \
#     bash bench/device/detached.sh bash bench/device/startup_gpu.sh /tmp/xout/startup
set -uo pipefail
out=${1:?usage: startup_gpu.sh OUT}
campaign=${CAMPAIGN:-campaigns/h200_te.yaml}
mkdir -p "$out"
# A alone in a new process first: how much its losses differ between new processes, against which
# A's run again after B is judged.
TORCHDYNAMO_DISABLE=1 python3 bench/reused_process.py --campaign "$campaign" --first-only \
  --out "$out/reused_process_cold_reference.json" > "$out/reused_process_cold_reference.log" 2>&1
TORCHDYNAMO_DISABLE=1 python3 bench/reused_process.py --campaign "$campaign" --out "$out/reused_process_eager.json" \
  --cold-reference "$out/reused_process_cold_reference.json" 2>&1 | tee "$out/reused_process_eager.log"
CAMPAIGN=$campaign bash bench/outside_steps_gpu.sh "$out/split" "${TRIALS:-8}"
python3 bench/reused_process.py --campaign "$campaign" --out "$out/reused_process.json" 2>&1 | tee "$out/reused_process.log"
