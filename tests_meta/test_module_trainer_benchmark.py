"""benchmarks/module_trainer_gpu.py (the module-built trainer's first GPU step, ModuleBuiltModel) on
the CPU: what runs without vLLM - bad arguments exit 2 with one line, the sequences are seeded
and in range, and the table reads fake results (equal, differing, n/a layers, errors) as the GPU
session will see them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "module_trainer_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("module_trainer_gpu", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv", [["--proxy", "tiny"], ["--sequences", "0"], ["--model", "no-such-model-xyz"],
                                  ["--fixes", "nonsense"], ["--frobnicate"], ["--sequences", "many"],
                                  ["--model", "qwen3", "--json", "/no/such/dir/out.json"]])
def test_bad_arguments_exit_2_with_one_line(bench, argv, capsys):
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert not err.startswith(("error: '", 'error: "')), err


def test_models_repeatable_and_comma_separated(bench):
    args = bench.parse_args(["--model", "qwen3,llama", "--model", "qwen3_moe"])
    assert [n for n, _ in args.models] == ["qwen3", "llama", "qwen3_moe"]
    assert (args.proxy, args.sequences, args.fixes) == ("shallow", 64, "all")


def test_sequences_seeded_and_in_range(bench):
    a, b = bench.sequences(64, 1000, 3), bench.sequences(64, 1000, 3)
    assert a == b and a != bench.sequences(64, 1000, 4)
    assert all(bench.MIN_LEN <= len(s) <= bench.MAX_LEN for s in a)
    assert all(0 <= t < 1000 for s in a for t in s)


def _diff(bench, lhs, rhs, a="module-built", b="engine"):
    import torch
    return bench._diff([torch.tensor(lhs)], [torch.tensor(rhs)], a, b)


def test_table_from_fake_results(bench):
    same = _diff(bench, [-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0])
    differ = _diff(bench, [-1.0, -2.0, -3.0], [-1.0, -2.0000002, -3.0])
    assert same["equal"] and not differ["equal"] and differ["first"] == [0, 1] and differ["ulp"] == 1
    results = [
        {"model": "qwen3", "proxy": "shallow", "family": "qwen3", "tokens": 3, "wrapped": {"linear": 4, "rms_norm": 3},
         "na": [], "error": None, "engine": differ, "engine_sampler_op": same, "sampler": "v2",
         "hand_written": differ, "hand_written_vs_engine": same, "times_s": {"module_forward": 1.25}},
        {"model": "gemma3_text", "proxy": "shallow", "family": "gemma3_text", "tokens": 3, "wrapped": {"linear": 2},
         "na": [{"path": "model.layers.0.self_attn.attn", "class": "Attention", "why": "sliding window 512"}],
         "error": None, "times_s": {}},
        {"model": "mixtral", "proxy": "shallow", "family": "mixtral", "tokens": 3, "wrapped": {}, "na": [],
         "error": "module-built: RuntimeError: no forward context", "times_s": {},
         "hand_written": "n/a: mixtral (hand-written for qwen3, qwen3_moe, llama)"},
    ]
    text = bench.table(results)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
    assert len(rows) == 3 and all(r.count("|") == 10 for r in rows)
    q, g, m = rows
    assert f"no: 1 of 3 differ; first at (0, 1): {differ['lhs_hex']} vs {differ['rhs_hex']} (1 ULP)" in q
    assert "yes (3) [v2]" in q and "linear 4, rms_norm 3" in q and "module_forward 1.2" in q
    assert "not run (n/a layers)" in g and "| 1 |" in g
    assert "error: module-built: RuntimeError" in m and "n/a: mixtral" in m
    assert "gemma3_text: n/a: model.layers.0.self_attn.attn is a Attention: sliding window 512" in text
    assert "first difference at sequence 0, token 1" in text        # format_difference's detail below
