"""What does an out-of-memory trial cost in kept ranks, against ranks newly forked from a warm zygote?
The issue's claim to check: in kept ranks an OOM costs its build, not a process start. In one kept
zygote: bring-up, then the campaign's out-of-memory config (MBS 8, which ran out of memory at its
first step on both the H100 and the H200), then bring-up again (it must start new ranks: an OOM's
ranks are never kept). Then the same OOM config in a second zygote, in ranks forked new. Each burst
gives its wall seconds, outcome, how its ranks started, its teardown's parts and, out of memory before
a step, where its seconds went (its set-up part by part, then the part it ran out of memory in).

  PYTHONPATH=/tmp/te-site:/tmp/site:$PWD python3 bench/device/kept_oom_gpu.py OUT.json [CAMPAIGN]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from autotune.campaign import load_campaign
from autotune.core.knobs import complete_config
from autotune.core.registry import start_rank_zygote
from trainables.launch import run_local
from trainables.probe import probe

OUT_OF_MEMORY = {"micro_batch_size": 8, "recompute_granularity": "selective",
                 "recompute_modules": ["core_attn", "moe_act"], "cuda_graph_impl": "transformer_engine",
                 "cuda_graph_scope": ["attn", "moe_router", "moe_preprocess"], "moe_grouped_gemm": True}
STEPS = 6


def timed(request, address: str) -> dict:
    started = time.perf_counter()
    result = run_local(request, reporter=lambda report: True, trainable="megatron", warm_ranks=address)
    return {"micro_batch_size": request.config.micro_batch_size, "outcome": result.outcome,
            "wall_s": round(time.perf_counter() - started, 2), "rank_start": result.rank_start,
            "steps": len(result.records), "error": (result.error or "")[:160],
            "teardown": [{"part": part.name, "s": round(part.seconds, 2)} for part in result.teardown],
            "before_first_step": [{"part": part.name, "s": round(part.seconds, 2)} for part in result.before_first_step]}


def main() -> None:
    out = Path(sys.argv[1])
    campaign = load_campaign(Path(sys.argv[2] if len(sys.argv) > 2 else "campaigns/h100_te.yaml"))
    bring_up = campaign.burst_request(campaign.space.warm_starts[0].config, STEPS)
    oom = campaign.burst_request(complete_config(OUT_OF_MEMORY, defaults=campaign.space.fixed), STEPS)
    bursts = []
    with tempfile.TemporaryDirectory(prefix="ko-") as folder:
        for name, sequence in (("kept", (bring_up, oom, bring_up)), ("new", (oom,))):
            address = f"{folder}/{name}.sock"
            zygote = start_rank_zygote(address, "megatron")
            try:
                for request in sequence:
                    bursts.append({"zygote": name, **timed(request, address)})
                    print(json.dumps(bursts[-1]), flush=True)
            finally:
                zygote.kill()
                zygote.wait()
    out.write_text(json.dumps({
        "what": "an out-of-memory burst in kept ranks (after a healthy burst) against one in ranks forked new",
        "date": time.strftime("%Y-%m-%d"), "campaign": campaign.spec.name, "steps": STEPS,
        "stack": probe(), "bursts": bursts}, indent=1))


if __name__ == "__main__":
    main()
