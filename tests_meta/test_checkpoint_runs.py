"""--proxy checkpoint (a --model directory with weights, tested as it is): C1's
test_checkpoint_weights_reach_the_trainer passes when the trainer loads the directory's files, and
fails - its negative control - for a trainer that loads other weights (here: another seed's)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.models.proxies import build_proxy

ROOT = Path(__file__).resolve().parents[1]

IGNORING_IMPL = '''
import os
from fixtures.reference.implementation import ReferenceImplementation

class LoadsOtherWeights(ReferenceImplementation):
    """A trainer that ignores the checkpoint it is given and loads another directory's weights."""
    def make_trainer(self, model_dir):
        return super().make_trainer(os.environ["OTHER_WEIGHTS"])

def make():
    return LoadsOtherWeights()
'''


def _c1(tmp_path, model: Path, *impl: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    env["OTHER_WEIGHTS"] = str(tmp_path / "other")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_c0_inventory/test_c1_proxy.py",
           "-k", "checkpoint_weights or loads_in_trainer", f"--model={model}", *impl]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("checkpoints")
    build_proxy("qwen3", "tiny", d / "mine", seed=5)
    build_proxy("qwen3", "tiny", d / "other", seed=6)
    (d / "ignoring_impl.py").write_text(IGNORING_IMPL)
    return d


def test_the_trainer_holds_the_checkpoint(checkpoints):
    proc = _c1(checkpoints, checkpoints / "mine")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]


def test_a_trainer_that_loads_other_weights_is_caught(checkpoints):
    proc = _c1(checkpoints, checkpoints / "mine", "--impl", "ignoring_impl:make")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "the trainer did not load the checkpoint" in out, out[-3000:]
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]    # it still loads and runs: only C1's check sees it


def test_weight_bytes_are_the_safetensors_files(tmp_path):
    """What a GPU trainer makes room for (a multiple of it): the model directory's safetensors
    bytes, config.json and other files not counted; a directory without weights has none."""
    from fixtures.models.checkpoint import weight_bytes
    proxy = build_proxy("qwen3", "tiny", tmp_path / "p", seed=0)
    files = list(Path(proxy.path).glob("*.safetensors"))
    assert files and weight_bytes(proxy.path) == sum(f.stat().st_size for f in files)
    (tmp_path / "empty").mkdir()
    assert weight_bytes(tmp_path / "empty") == 0
