"""An engine whose constructor refuses its options, through ``hybridrl train`` as a user runs it: the run stops
with exit code 1 and one line naming the role, the backend and the engine's own message, not Ray's wrapping of
the worker's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

PLUGIN = '''
from hybridrl import hookimpl
from hybridrl_fsdp.engine import FSDPEngine


class Refuses(FSDPEngine):
    def __init__(self, ctx):
        raise ValueError("roles.actor.options.head: 'tail' is not a head (lm, value, reward)")


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_train_engine("refuses", Refuses, process_family="torch-dist", supports={"checkpoint"})
'''


def test_a_constructor_error_reaches_the_user_as_one_line(tmp_path):
    (tmp_path / "refusing_plugin.py").write_text(PLUGIN)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HYBRIDRL_PLUGINS": "refusing_plugin"}
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), "trainer.steps=1",
                           f"trainer.out={tmp_path / 'run'}", "roles.actor.backend=refuses", "roles.ref.backend=fsdp",
                           "trainer.progress=false"], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("hybridrl: roles.actor: the 'refuses' engine did not start: ValueError: "
                    "roles.actor.options.head: 'tail' is not a head (lm, value, reward)"), proc.stderr[-3000:]
    assert "RayTaskError" not in proc.stderr, proc.stderr[-3000:]
