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
