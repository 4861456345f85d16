"""The advisor's ranked maps for large models on clusters nobody here has run: predictions, not measurements.

For each config and cluster, ``hybridrl plan CONFIG --advise --cluster NxG --json`` with the default (unprofiled)
cost model and 80 GiB devices, written to ``results/advice_<model>_<cluster>.json``. No multi-GPU run checked
these: a profiled run on the cluster (``--profile RUN``) and the measured step of the top maps would.

    python benchmarks/advice_clusters.py                      # 7B and 32B on 1x8, 2x8, 4x8 (a minute of CPU)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = {"7b": "examples/qwen7b-colocated.yaml", "32b": "examples/qwen32b-colocated.yaml"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b,32b", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--clusters", default="1x8,2x8,4x8")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    args = parser.parse_args()
    for model in args.models.split(","):
        for cluster in args.clusters.split(","):
            out = Path(args.out_dir) / f"advice_{model}_{cluster}.json"
            cmd = [sys.executable, "-m", "hybridrl.cli", "plan", CONFIGS[model], "--advise", "--cluster", cluster,
                   "--skip-engine-check", "--json", str(out)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd[2:])} failed: {done.stderr.strip()[-2000:]}")
            best = next((line for line in done.stdout.splitlines() if line.startswith("best:")), "best: none fits")
            print(f"{model} {cluster}: {best.split(':', 2)[1].strip()} -> {out.name}")


if __name__ == "__main__":
    main()
