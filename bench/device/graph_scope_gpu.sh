#!/bin/bash
# On the GPU machine (TE and .dev kits installed): the evidence of cuda_graph_scope on real TE graphs.
# One short burst per scope of the TE campaign's space (MBS 4, no recompute, grouped GEMM); each
# burst's JSON carries the scope its graphs were seen to hold (te_graphed_scope: the parts whose
# Python stopped running once captured) and the check against the config.
#   bash .dev/setup.sh && PYTHONPATH=/tmp/te-site:/tmp/site:$PWD bash bench/device/graph_scope_gpu.sh /tmp/xout/scope
set -uo pipefail
out=${1:?usage: graph_scope_gpu.sh OUT}
campaign=${CAMPAIGN:-campaigns/h200_te.yaml}
mkdir -p "$out"
# The safe scope first: attn alone was seen graphed on an H100 (2026-12-06), the others not yet.
for scope in attn,moe_router,moe_preprocess attn,moe_router attn; do
  list=$(printf '"%s",' ${scope//,/ }); list="[${list%,}]"
  timeout 150 python3 -m autotune burst -c "$campaign" --steps 6 --json "$out/${scope//,/-}.json" --config \
    "{\"micro_batch_size\": 4, \"recompute_granularity\": \"none\", \"moe_grouped_gemm\": true,
      \"cuda_graph_impl\": \"transformer_engine\", \"cuda_graph_scope\": $list}" > "$out/${scope//,/-}.log" 2>&1
  python3 - "$out/${scope//,/-}.json" "$scope" <<'PY'
import json, sys
evidence = json.load(open(sys.argv[1])).get("evidence", {})
print(sys.argv[2], "→ graphed", evidence.get("te_graphed_scope"), "· check", evidence.get("checks", {}).get("cuda_graph_scope"),
      "· replays", evidence.get("te_graph_replays"))
PY
done
