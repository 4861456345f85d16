"""What the checkpoint manifest costs: the sizes and CRC-32s taken at every save (``write_manifest``) and the
check before a resume or export (``damage``), against writing the same bytes.

    python benchmarks/checkpoint_manifest.py [--gib 1] [--files 8] [--dir /path/on/the/checkpoint/filesystem]

Writes shards of random bytes (fsynced, like a save), then times the manifest and the checks, and writes
``benchmarks/results/checkpoint_manifest.json``. Run it on the filesystem the checkpoints go to: the checks
read every byte back (from the page cache right after a save, from the disk before a resume in a new process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from hybridrl.run import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


def write_shards(folder: Path, total: int, files: int) -> float:
    start = time.perf_counter()
    chunk = os.urandom(16 << 20)
    for i in range(files):
        with open(folder / f"__{i}_0.distcp", "wb") as f:
            left = total // files
            while left > 0:
                f.write(chunk[:min(left, len(chunk))])
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes of the fake checkpoint, in GiB")
    parser.add_argument("--files", type=int, default=8, help="shards it is cut into (ranks x files per rank)")
    parser.add_argument("--dir", help="where to write it (default: a temporary folder)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_manifest.json"))
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="manifest-bench-", dir=args.dir))
    try:
        folder = base / "step_000001"
        (folder / "actor").mkdir(parents=True)
        total = int(args.gib * 2**30)
        write_s = write_shards(folder / "actor", total, args.files)
        manifest_s = timed(lambda: ckpt.write_manifest(folder))
        (folder / ckpt.DRIVER_SUMMARY).write_text('{"step": 1}')
        check_s = timed(lambda: ckpt.damage(folder))
        sizes_s = timed(lambda: ckpt.damage(folder, checksums=False))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = total / 1e9
    result = {"bytes": total, "files": args.files, "threads": min(8, os.cpu_count() or 1),
              "write_fsync_s": write_s, "manifest_s": manifest_s, "check_s": check_s, "sizes_only_s": sizes_s,
              "manifest_gb_per_s": gb / manifest_s, "check_gb_per_s": gb / check_s,
              "manifest_share_of_write": manifest_s / write_s}
    for key, value in result.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
