"""Does a warm rank zygote holding a trainable's stack fork ranks that can use the GPU, and what
does it save? For each GPU trainable: start its zygote (timed), read its thread count (a fork copies
only the forking thread: a zygote's own threads must not hold locks the child needs), then fork a
rank that reports which heavy modules it found imported, initialises CUDA and runs a matmul (timed
from the fork request), against a fresh interpreter doing the same imports and CUDA work.

  python bench/device/zygote_check.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pipe
from pathlib import Path

from autotune.core.registry import start_rank_zygote, trainable_support
from trainables.probe import probe
from trainables.zygote import Zygote

WATCHED = ("huggingface_hub", "transformers", "megatron.core", "megatron.bridge", "transformer_engine")


def rank_work(relay, imports: tuple[str, ...]) -> None:
    """What a rank does first: its stack's imports (free where the zygote holds them), then CUDA."""
    import importlib

    started = time.perf_counter()
    found = {module: module in sys.modules for module in WATCHED}
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    imported = time.perf_counter()
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    (x @ x).sum().item()
    relay.send({"found_imported": found, "imports_s": imported - started,
                "cuda_s": time.perf_counter() - imported})


def threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def check(trainable: str, folder: Path) -> dict:
    imports = trainable_support(trainable).rank_imports
    started = time.perf_counter()
    process = start_rank_zygote(str(folder / f"{trainable}.sock"), trainable)
    zygote_start = time.perf_counter() - started
    try:
        ours, theirs = Pipe()
        requested = time.perf_counter()
        child = Zygote(str(folder / f"{trainable}.sock")).fork("zygote_check:rank_work", (imports,), theirs)
        theirs.close()
        warm = ours.recv() if ours.poll(300) else {"error": "no answer in 300 s"}
        warm["fork_to_done_s"] = time.perf_counter() - requested
        child.join(timeout=60)
        warm["exitcode"] = child.exitcode
        zygote_threads = threads(process.pid)
    finally:
        process.kill()
        process.wait()
    code = (f"import sys, time, json; t=time.perf_counter(); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from multiprocessing import Pipe; import zygote_check; a, b = Pipe(); "
            f"zygote_check.rank_work(b, {imports!r}); r = a.recv(); r['wall_s'] = time.perf_counter() - t; "
            "print(json.dumps(r))")
    requested = time.perf_counter()
    cold = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    cold["process_to_done_s"] = time.perf_counter() - requested
    return {"trainable": trainable, "rank_imports": imports, "zygote_start_s": zygote_start,
            "zygote_threads": zygote_threads, "warm_rank": warm, "cold_rank": cold}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    results = []
    with tempfile.TemporaryDirectory(prefix="zc-") as folder:
        for trainable in ("megatron", "bridge"):
            results.append(check(trainable, Path(folder)))
            print(json.dumps(results[-1], indent=1), flush=True)
    stack = probe()  # after the checks: probing initialises CUDA in this process
    Path(sys.argv[1]).write_text(json.dumps({
        "what": "rank zygote holding each GPU trainable's stack: fork to first CUDA matmul, warm vs a fresh interpreter",
        "date": time.strftime("%Y-%m-%d"), "stack": stack,
        "results": results}, indent=1))


if __name__ == "__main__":
    main()
