"""Proxy footprints (fixtures.models.footprint): a run whose real-width proxy files cannot fit the
disk is one line before any check, with each model's bytes, the free space and what fits."""
from __future__ import annotations

import pytest
import torch

from fixtures.models.footprint import Footprint, check_disk, footprint
from fixtures.models.proxies import proxy_config, source_config
from fixtures.models.reduce import ProxyError


def test_bytes_follow_the_parameters_and_the_dtype():
    cfg = proxy_config(source_config("qwen3"), "shallow")
    bf16, fp32 = footprint("qwen3", cfg, "shallow", torch.bfloat16), footprint("qwen3", cfg, "shallow", torch.float32)
    assert bf16.params == fp32.params > 1e9 and fp32.bytes == 2 * bf16.bytes == 4 * bf16.params


def test_fits_gives_the_header_line():
    line = check_disk([Footprint("qwen3", "shallow", 10**9, 2 * 10**9)], copies=4, where="/tmp", free=100 * 2**30)
    assert line.startswith("proxy weight files: 7.5 GiB (4 copies of qwen3 (shallow)") and "100.0 GiB free" in line


def test_does_not_fit_is_one_line_with_what_fits():
    big = Footprint("deepseek_v3", "shallow", 30 * 10**9, 60 * 10**9)
    with pytest.raises(ProxyError) as err:
        check_disk([big], copies=4, where="/tmp", free=64 * 2**30)
    msg = str(err.value)
    assert "\n" not in msg and "do not fit the disk" in msg and "--proxy-weights engine-dummy" in msg
    assert "223.5 GiB (4 copies" in msg and "64.0 GiB free" in msg and "-n 1" in msg
    check_disk([big], copies=1, where="/tmp", free=64 * 2**30)      # control: one copy fits


# ---------------------------------------------------------------------------------------------
# fewer routed experts where a real-width proxy does not fit (--proxy-experts)
# ---------------------------------------------------------------------------------------------
def src(model: str):
    from fixtures.models.proxies import resolve_model
    return source_config(resolve_model(model))


@pytest.mark.parametrize("model, least", [("deepseek_v3", 16), ("gpt_oss", 5), ("mixtral", 3), ("qwen3_moe", 9)])
def test_the_fewest_experts_keep_the_routing_shape(model, least):
    from fixtures.models.reduce import experts_cut_problems, fewest_experts, routing_shape
    real = proxy_config(src(model), "shallow")
    assert fewest_experts(routing_shape(real.to_dict())) == least
    cut = proxy_config(src(model), "shallow", least)
    assert routing_shape(cut.to_dict())["experts"] == least and cut.hidden_size == real.hidden_size
    assert experts_cut_problems(real.to_dict(), cut.to_dict()) == []
    with pytest.raises(ProxyError, match=f"at least {least}"):
        proxy_config(src(model), "shallow", least - 1)


def test_a_cut_that_breaks_the_routing_shape_is_seen():
    """The C1 check's negative control: top_k changed, or experts at top_k, is named."""
    from fixtures.models.reduce import experts_cut_problems
    real = proxy_config(src("deepseek_v3"), "shallow").to_dict()
    bad = {**proxy_config(src("deepseek_v3"), "shallow", 16).to_dict(), "num_experts_per_tok": 4}
    assert any("top_k" in p for p in experts_cut_problems(real, bad))
    bad = {**real, "n_routed_experts": 8, "onpolicy_reduced_experts": {"n_routed_experts": [256, 8]}}
    assert any("outside [16, 256]" in p for p in experts_cut_problems(real, bad))


def test_the_most_experts_that_fit_a_budget():
    from fixtures.models.footprint import experts_to_fit
    ds = src("deepseek_v3")
    def weigh(n):
        return footprint("deepseek_v3", proxy_config(ds, "shallow", n), "shallow", torch.bfloat16).bytes
    budget = 10 * 2**30
    n = experts_to_fit(lambda k: proxy_config(ds, "shallow", k), "deepseek_v3", "shallow", torch.bfloat16, budget)
    assert n % 8 == 0 and weigh(n) <= budget < weigh(n + 8)
    assert experts_to_fit(lambda k: proxy_config(ds, "shallow", k), "deepseek_v3", "shallow", torch.bfloat16,
                          2**30) is None                       # even 16 experts weigh more
    llama = src("llama")
    assert experts_to_fit(lambda k: proxy_config(llama, "shallow", k), "llama", "shallow", torch.bfloat16, budget) is None


def test_auto_cuts_the_experts_to_fit_the_disk_and_says_so(monkeypatch):
    """--proxy-experts auto: deepseek_v3 shallow (26 GiB in bf16) on a disk with 40 GiB free at -n 2:
    each copy gets 20 GiB, so the experts are cut to the most that fit, said in the header."""
    import shutil
    import types
    from fixtures.models.proxies import resolve_model
    from fixtures.plugin import session
    from fixtures.runtime.run_state import RunState
    model = resolve_model("deepseek_v3")
    monkeypatch.setattr(shutil, "disk_usage", lambda where: types.SimpleNamespace(free=40 * 2**30))
    state = RunState(impl=types.SimpleNamespace(dtype=lambda: torch.bfloat16))
    sources = {model: src(model)}
    sized = [(model, footprint("deepseek_v3", proxy_config(sources[model], "shallow"), "shallow", torch.bfloat16),
              proxy_config(sources[model], "shallow"))]
    experts = {}
    assert session._fit_experts_to_the_disk(sources, "shallow", sized, experts, 2, "/tmp", state)
    n = experts[model]
    cfg = proxy_config(sources[model], "shallow", n)
    assert 16 <= n < 256 and 2 * footprint("deepseek_v3", cfg, "shallow", torch.bfloat16).bytes <= 40 * 2**30
    said = session._experts_said(model, cfg, "shallow")
    assert f"n_routed_experts 256 -> {n} routed experts" in said and "top_k 8 and 8 expert groups (4 routed) kept" in said


def test_auto_cuts_the_experts_to_fit_the_card(monkeypatch):
    """On an H100 80 GB one worker of deepseek_v3 shallow (26 GiB of weights, 3 copies) does not fit:
    auto cuts its experts until one worker's estimated peak does."""
    import types
    from fixtures.models.proxies import resolve_model
    from fixtures.plugin import session
    from fixtures.runtime import card_sizing as S
    from fixtures.runtime.run_state import RunState
    monkeypatch.setattr(S, "first_device", lambda: S.Device("NVIDIA H100 80GB HBM3", 81559 << 20))
    monkeypatch.delenv("CONFORMANCE_VLLM_GPU_MEMORY_BUDGET", raising=False)
    model = resolve_model("deepseek_v3")
    sources = {model: src(model)}
    cfg = proxy_config(sources[model], "shallow")
    sized = [(model, footprint("deepseek_v3", cfg, "shallow", torch.bfloat16), cfg)]
    opts = types.SimpleNamespace(trainer_micro_batch_tokens=None)
    config = types.SimpleNamespace(option=opts, getoption=lambda name, default=None: getattr(opts, name, default))
    experts = {}
    state = RunState(impl=types.SimpleNamespace(dtype=lambda: torch.bfloat16))
    assert session._fit_experts_to_the_card(session._the_card(config), state, sources, "shallow", sized, experts)
    fp = footprint("deepseek_v3", proxy_config(sources[model], "shallow", experts[model]), "shallow", torch.bfloat16)
    need = S.worker_need(fp.bytes, cfg.vocab_size, 8192).total
    assert 16 <= experts[model] < 256 and need <= 0.85 * (81559 << 20)
