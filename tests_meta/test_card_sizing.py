"""Card sizing (fixtures.runtime.card_sizing): at most the xdist workers whose estimated peak fits the
card the run finds, said in the header. Fake devices: an H100 80 GB and an H200 141 GB."""
from __future__ import annotations

import types

import pytest
import torch

from fixtures.runtime import card_sizing as S
from fixtures.runtime.run_state import RunState
from fixtures.models.footprint import footprint
from fixtures.models.proxies import proxy_config, source_config

H100, H200 = S.Device("NVIDIA H100 80GB HBM3", 81559 << 20), S.Device("NVIDIA H200", 143771 << 20)


def _need(model: str):
    cfg = proxy_config(source_config(model), "shallow")
    return S.worker_need(footprint(model, cfg, "shallow", torch.bfloat16).bytes, cfg.vocab_size, 8192)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_the_measured_cards_get_the_measured_worker_counts(model):
    """qwen3 shallow on an H100 80 GB: nine checks out of memory at -n 4 (2026-12-05), one at 2
    workers (a worker held 35.5 GiB: docs/results/2026-12-06-h100-card-sizing.md): 1 worker there,
    3 on an H200 141 GB."""
    need = _need(model)
    assert need.total > 35.5 * S.GIB
    assert S.workers_that_fit(4, H100, need, 0.85)[0] == 1
    assert S.workers_that_fit(4, H200, need, 0.85)[0] == 3
    n, said = S.workers_that_fit(16, H100, need, 0.85)          # -n auto on a 16-core host
    assert n == 1 and said.startswith("16 workers asked, 1 runs: NVIDIA H100 80GB HBM3 79.6 GiB x 0.85") and "1 fit" in said


def test_never_fewer_than_one_and_never_more_than_asked():
    huge = S.WorkerNeed(weights=200 * S.GIB, logits=0)
    assert S.workers_that_fit(4, H100, huge, 0.85)[0] == 1
    assert S.workers_that_fit(1, H200, _need("qwen3"), 0.85)[0] == 1


def test_the_controller_starts_only_the_workers_that_fit(monkeypatch, fake_vllm_impl):
    from fixtures.plugin import session
    from fixtures.runtime.gpu_memory import SHARERS_ENV
    monkeypatch.setattr(S, "first_device", lambda: H100)
    monkeypatch.delenv("CONFORMANCE_VLLM_GPU_MEMORY_BUDGET", raising=False)
    monkeypatch.setenv(SHARERS_ENV, "4")          # -n 4 counted before the sizing (session._count_gpu_sharers)
    cfg = proxy_config(source_config("qwen3"), "shallow")
    fp = footprint("qwen3", cfg, "shallow", torch.bfloat16)
    opts = types.SimpleNamespace(numprocesses=4, tx=["popen"] * 4, trainer_micro_batch_tokens=None)
    config = types.SimpleNamespace(option=opts, getoption=lambda name, default=None: getattr(opts, name, default))
    state = RunState()
    session._fit_workers_to_the_card(config, state, session._the_card(config), [(fp, cfg)])
    assert opts.numprocesses == 1 and opts.tx == ["popen"]
    assert state.sizing.startswith("4 workers asked, 1 runs")
    # the header's budget line is the workers that run, though the implementation was made before the cut
    assert "1 worker sharing it = 0.85 each" in fake_vllm_impl.describe()["gpu_memory_budget"]
    monkeypatch.setattr(S, "first_device", lambda: None)       # no GPU to read: nothing changes
    opts.numprocesses, opts.tx = 4, ["popen"] * 4
    session._fit_workers_to_the_card(config, {}, session._the_card(config), [(fp, cfg)])
    assert opts.numprocesses == 4


def test_nvidia_smi_output_is_read(monkeypatch):
    out = types.SimpleNamespace(stdout="NVIDIA H100 80GB HBM3, 81559\n")
    monkeypatch.setattr(S.subprocess, "run", lambda *a, **k: out)
    assert S.first_device() == H100
    monkeypatch.setattr(S.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("nvidia-smi")))
    assert S.first_device() is None
