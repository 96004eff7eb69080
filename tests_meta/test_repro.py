"""Minimal repro artifacts: a planted fault's first diverging op replays alone and shows the
mismatch; the same replay without the fault shows none (the replay is faithful, not noisy)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fixtures.faults.catalog import get
from fixtures.diagnose.localise import Rows, localise
from fixtures.models.proxies import build_proxy
from fixtures.reference.implementation import ReferenceImplementation
from fixtures.diagnose.repro import capture_first_call, write_repro


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    torch.set_num_threads(1)
    spec = build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama"))
    return ReferenceImplementation().make_trainer(spec.path)


def _batch():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 17, 20, 9, 20, 20, 12, 20)]


@pytest.mark.parametrize("planted", [True, False], ids=["fault", "no-fault"])
def test_replay_script_reproduces_exactly_the_planted_mismatch(trainer, tmp_path, planted):
    fault = get("matmul_split_k_rows")
    batch, i = _batch(), 3
    n, width = len(batch[i]), max(len(s) for s in batch)
    run_a = lambda: trainer.logprobs([batch[i]])
    run_b = lambda: trainer.logprobs(batch)
    model = trainer.module()
    with fault.active():
        loc = localise(run_a, run_b, model, Rows.row(0, n), Rows.row(i, n), names=("alone", "in batch"))
        assert loc is not None and loc.op == "aten.mm", loc
        module, op = loc.module, loc.op
        side_a = capture_first_call(run_a, model, module, op)
        side_b = capture_first_call(run_b, model, module, op)
    assert side_b["args"][0].shape[0] == len(batch) * width
    script = write_repro(tmp_path / "repro", module=module, op=op, side_a=side_a, side_b=side_b,
                         rows_a=range(n), rows_b=range(i * width, i * width + n), names=("alone", "in batch"),
                         kernel_mode=True, kernel_fault=fault.name if planted else None)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=script.parent,
                         timeout=300)
    if planted:
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"{op} in {module}" in res.stdout and "output elements differ" in res.stdout
        assert "[alone]" in res.stdout and "[in batch]" in res.stdout
    else:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "no mismatch" in res.stdout
