"""The embedded CPU demo campaign end to end: wall time, trials by outcome, the winner against the
bring-up config (both promoted for the same steps), and the device-seconds it took.

Run:  .venv/bin/python bench/campaign_cpu.py [--out bench/results/campaign_cpu.json]
Runs ``autotune run`` (the built-in ``cpu_demo`` campaign, a fresh local Ray cluster) into a
temporary output directory and writes one JSON with the figures and the winner's contract.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from autotune.report.analysis import load_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results/campaign_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="campaign-cpu-") as output:
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "autotune", "run", "--output-dir", output], check=True,
                       env={**os.environ, "RAY_ADDRESS": ""})
        wall = time.monotonic() - started
        (run_dir,) = Path(output).iterdir()
        spend = json.loads((run_dir / "spend.json").read_text())
        run = load_report(run_dir)  # what `autotune report` reads: the verdict, bring-up, the gain
    screened = [e for e in run.entries if e.stage == "screen"]
    bring_up, bring_up_long, winner, gain = run.bring_up, run.bring_up_promoted, run.winner, run.gain_over_bring_up()
    report = {
        "benchmark": "campaign_cpu",
        "command": "python bench/campaign_cpu.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_seconds": wall,
        "screening": {"launched": sum(e.launched for e in screened), "outcomes": Counter(e.outcome for e in screened)},
        "promoted": len([e for e in run.entries if e.stage == "promote"]),
        "verdict": run.board.verdict,
        "spend": spend,
        "objective": "useful_tokens_per_s_per_gpu",
        "bring_up_screen": None if bring_up is None else {"objective": bring_up.objective, "outcome": bring_up.outcome},
        "bring_up_promoted": None if bring_up_long is None else bring_up_long.to_json(),
        "winner": None if winner is None else winner.to_json(),
        # both runs as long as each other: the ratio of their means less one, bounded by their intervals
        "gain_over_bring_up": None if gain is None else {"value": gain.value, "low": gain.low, "high": gain.high,
                                                         "steps": gain.steps, "tie": gain.tie},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{wall:.0f} s · screening {dict(report['screening']['outcomes'])} · {report['verdict']}"
          + (f" · winner over bring-up {gain.describe()}" if gain is not None else ""))


if __name__ == "__main__":
    main()
