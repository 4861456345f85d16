"""Two ``hybridrl train`` into one ``trainer.out``: while the first runs, a second run, an ``--overwrite`` and an
export are refused naming it (host, pid, since), and nothing of its folder moves; killed with SIGKILL, it leaves
a lock that the next run takes over, saying so in one line, and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from hybridrl.run import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")
QUICK = ["data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false", "trainer.log_samples=0",
         "trainer.save_every=1"]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_once_it_is_killed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    log = tmp_path / "first.log"
    first = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", QUICKSTART, f"trainer.out={out}",
                              "trainer.steps=500", *QUICK], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while ckpt.latest_checkpoint(out) is None:  # running, with a checkpoint to resume from later
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        record = json.loads((out / ".lock").read_text())
        assert record["pid"] == first.pid and record["host"] == socket.gethostname()
        assert stat.S_IMODE(out.stat().st_mode) == 0o700 and stat.S_IMODE((out / "config.json").stat().st_mode) == 0o600
        holder = f"host {socket.gethostname()}, pid {first.pid}, since"
        second = cli("train", QUICKSTART, f"trainer.out={out}", "trainer.steps=500", *QUICK)
        assert second.returncode == 2 and holder in second.stderr and "in use by a live run" in second.stderr
        overwrite = cli("train", QUICKSTART, f"trainer.out={out}", "trainer.steps=500", *QUICK, "--overwrite")
        assert overwrite.returncode == 2 and holder in overwrite.stderr and "move it aside" in overwrite.stderr
        export = cli("export", str(out), "--out", str(tmp_path / "export"))
        assert export.returncode == 2 and holder in export.stderr
        for proc in (second, overwrite, export):
            assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["first.log", "run"]  # nothing moved aside
        assert first.poll() is None  # the first run went on
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # no clean-up: the lock file keeps its record
        first.wait(timeout=60)
    step = int(ckpt.latest_checkpoint(out).name.removeprefix("step_"))
    third = cli("train", QUICKSTART, f"trainer.out={out}", f"trainer.steps={step + 1}", *QUICK)
    assert third.returncode == 0, third.stderr[-3000:]
    took = [line for line in third.stdout.splitlines() if "took over the lock" in line]
    assert len(took) == 1 and f"pid {first.pid}" in took[0]
    assert ckpt.latest_checkpoint(out).name == ckpt.step_dir_name(step + 1)  # resumed, one more step, saved
    assert (out / ".lock").read_text() == ""  # released when the run ended: nothing left to take over
