"""benchmarks/mamba2_kernels_gpu.py (vLLM's Mamba-2 and FP8 kernels' row invariance, design
docs/design/mamba2-and-fp8.md section E) on the CPU: what runs without a GPU - the arguments and
their defaults, bad arguments exit 2 with one line, a machine without CUDA or vLLM exits 3 with
one line, the run order, and the row comparison and table on planted tensors."""
from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "mamba2_kernels_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("mamba2_kernels_gpu", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_defaults(bench):
    args = bench.parse_args([])
    assert args.probe_list == list(bench.PROBES) and args.chunk_list == [128, 256]
    assert args.moe_list == [(8, 2), (64, 8)] and args.seed == 0 and not args.stock and args.json is None
    assert args.replay_schedules == 4 and "replay" in args.probe_list


def test_probes_chunks_and_moe_parsed(bench, tmp_path):
    args = bench.parse_args(["--probes", "fp8_moe, ssd_prefix", "--chunk-sizes", "256,128,256", "--moe", "16X4",
                             "--seed", "7", "--stock", "--json", str(tmp_path / "r.json")])
    assert args.probe_list == ["ssd_prefix", "fp8_moe"]        # in run order, not as given
    assert args.chunk_list == [256, 128] and args.moe_list == [(16, 4)] and args.seed == 7 and args.stock


def test_replay_probe_registered_and_its_argument_parsed(bench):
    args = bench.parse_args(["--probes", "replay,ssd_packed", "--replay-schedules", "0"])
    assert args.probe_list == ["ssd_packed", "replay"] and args.replay_schedules == 0
    assert bench.PROBE_FUNCS["replay"] is bench.probe_replay and "replay" in bench.PER_CHUNK
    assert bench.jobs(["replay"], [128, 256]) == [("replay", 128), ("replay", 256)]


@pytest.mark.parametrize("argv", [["--probes", "ssd,conv"], ["--probes", ","], ["--chunk-sizes", "100"],
                                  ["--chunk-sizes", "8"], ["--chunk-sizes", "abc"], ["--chunk-sizes", ""],
                                  ["--moe", "8"], ["--moe", "4x8"], ["--moe", "1x1"], ["--seed", "x"],
                                  ["--budget-s", "0"], ["--replay-schedules", "-1"], ["--replay-schedules", "101"],
                                  ["--replay-schedules", "2.5"], ["--frobnicate"], ["--json", "/no/such/dir/out.json"]])
def test_bad_arguments_exit_2_with_one_line(bench, argv, capsys):
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err


def test_no_cuda_exits_3_with_one_line(bench, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--probes", "conv"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: no CUDA device") and "nothing measured" in err


def test_no_vllm_exits_3_with_one_line(bench, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert bench.main([]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: vLLM is not installed"), err


def test_run_order(bench):
    jobs = bench.jobs(list(bench.PROBES), [128, 256])
    assert jobs[:len(bench.PROBES)] == [(p, None if p in ("fp8_linear", "fp8_moe") else 128) for p in bench.PROBES]
    assert jobs[len(bench.PROBES) - 1] == ("ssd_two_process", 128)
    assert jobs[len(bench.PROBES):] == [("ssd_prefix", 256), ("ssd_packed", 256), ("ssd_rerun", 256), ("replay", 256),
                                        ("ssu", 256)]
    assert bench.jobs(["fp8_linear"], [64, 128]) == [("fp8_linear", None)]


def _f32_hex(x: float) -> str:
    return "0x" + struct.pack(">f", x).hex()


def test_row_diff_planted_float32(bench):
    a = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[3, 2, 1] = torch.nextafter(a[3, 2, 1], torch.tensor(float("inf")))       # 1 ULP, row 3, column 2*5+1
    b[5, 0, 0] = torch.nextafter(torch.nextafter(a[5, 0, 0], torch.tensor(0.0)), torch.tensor(0.0))   # 2 ULP
    d = bench.row_diff(b, a)
    assert d["verdict"] == "variant" and d["rows"] == 6 and d["cols"] == 20
    assert d["rows_differing"] == 2 and d["elements_differing"] == 2 and d["first"] == [3, 11]
    assert d["lhs_hex"] == _f32_hex(b[3, 2, 1].item()) and d["rhs_hex"] == _f32_hex(a[3, 2, 1].item())
    assert d["lhs_hex"] != d["rhs_hex"] and d["lhs_value"] == b[3, 2, 1].item() and d["max_ulp"] == 2
    assert d["nan"] == 0


def test_row_diff_planted_bf16_and_fp8(bench):
    a = torch.linspace(-3, 3, 40).reshape(8, 5).to(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[7, 4] += 3                       # 3 ULP in the last row
    d = bench.row_diff(a, b)
    assert d["first"] == [7, 4] and d["max_ulp"] == 3 and d["rows_differing"] == 1
    assert d["lhs_hex"] == f"0x{a.view(torch.int16)[7, 4].item() & 0xFFFF:04x}" and len(d["rhs_hex"]) == 6
    q = a.float().to(torch.float8_e4m3fn)
    r = q.clone()
    r.view(torch.int8)[2, 0] += 1
    d = bench.row_diff(q, r)
    assert d["first"] == [2, 0] and d["max_ulp"] is None and len(d["lhs_hex"]) == 4 and d["verdict"] == "variant"


def test_row_diff_equal_and_signed_zero(bench):
    a = torch.randn(3, 7)
    d = bench.row_diff(a, a.clone())
    assert d["verdict"] == "invariant" and d["rows_differing"] == 0 and d["first"] is None and d["max_ulp"] is None
    nan = torch.full((2, 2), float("nan"))
    assert bench.row_diff(nan, nan.clone())["verdict"] == "invariant"          # the same bits
    z = torch.zeros(2, 2)
    d = bench.row_diff(z, -z)                                                 # bitwise: -0.0 is not +0.0
    assert d["verdict"] == "variant" and d["max_ulp"] == 0 and d["rhs_hex"] == "0x80000000"
    with pytest.raises(ValueError, match="cannot compare"):
        bench.row_diff(a, a.double())


def test_case_records_an_error_and_goes_on(bench, capsys):
    cases = []
    bench.case(cases, "M=1", 1, lambda: (_ for _ in ()).throw(RuntimeError("no kernel image\nmore")))
    bench.case(cases, "M=2", 2, lambda: (torch.ones(2, 3), torch.ones(2, 3)))
    assert cases[0] == {"case": "M=1", "size": 1, "error": "RuntimeError: no kernel image", "verdict": "error"}
    assert cases[1]["verdict"] == "invariant"
    s = bench.summarize({"name": "g", "cases": cases})
    assert s["verdict"] == "error" and s["errors"] == ["M=1: RuntimeError: no kernel image"]
    assert bench.summarize({"name": "g", "cases": cases[1:]})["verdict"] == "invariant"
    assert bench.summarize({"name": "g", "cases": []})["verdict"] == "error"


def test_table_from_planted_results(bench):
    ref = torch.randn(5, 4)
    moved = ref.clone()
    moved[2, 1] = torch.nextafter(ref[2, 1], torch.tensor(float("inf")))
    same, differ = [], []
    bench.case(same, "L'=37", 37, lambda: (ref, ref.clone()))
    bench.case(differ, "M=65", 65, lambda: (moved, ref))
    bench.case(differ, "M=1", 1, lambda: (ref[:1], ref[:1].clone()))
    results = {"meta": {"VLLM_BATCH_INVARIANT": "1", "vllm": "0.26.0", "seed": 0},
               "probes": [{"probe": "ssd_prefix", "chunk_size": 128,
                           "groups": [{"name": "prefix", "shape": "H=128", "cases": same, "expected": "invariant"}]},
                          {"probe": "fp8_linear", "chunk_size": None,
                           "groups": [{"name": "per-token", "shape": "N=4096 K=4096", "cases": differ,
                                       "expected": "variant", "notes": {"cutlass": True}}]},
                          {"probe": "fp8_moe", "chunk_size": None, "error": "ImportError: no fused_moe"},
                          {"probe": "ssd_two_process", "chunk_size": 128, "skipped": "time budget (120 s) spent"}]}
    text = bench.table(results)
    assert text.startswith("VLLM_BATCH_INVARIANT=1; vLLM 0.26.0")
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| probe")]
    assert len(rows) == 4 and all(r.count("|") == 10 for r in rows)
    p, f, m, t = rows
    assert "ssd_prefix (Q=128)" in p and "| 0 of 5 |" in p and p.rstrip().endswith("| invariant | invariant |")
    h = bench.row_diff(moved, ref)
    assert f"M=65: row 2, col 1: {h['lhs_hex']} vs {h['rhs_hex']}" in f and "| 1 of 6 |" in f and "| 1 | variant |" in f
    assert "| 65,1 |" in f
    assert "error: ImportError: no fused_moe" in m and "| error |" in m
    assert "skipped: time budget" in t
    assert "fp8_linear / per-token / M=65: 1 of 5 rows differ (1 elements); first at row 2, col 1" in text
    assert "fp8_linear / per-token: cutlass: True" in text
