"""The README's example adapter (examples/my_rl_adapter.py) is a real, working adapter: it passes
the contract self-test, and the gates run on it to a verdict per gate - pass, or not run / blocked
with n/a reasons that name the missing capability - never an AttributeError or a TypeError."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.checks.selftest import check_implementation
from fixtures.core.contract import (ChecksEngineKernels, DeclaresOptimizer, HasKernelMode, LogprobsWithGrad,
                                    ProvidesKernels, RecordsModuleOutputs, TrainsRL)

ROOT = Path(__file__).resolve().parents[1]
GATES = [f"C{i}" for i in range(10)]


def test_readme_points_to_the_example():
    readme = (ROOT / "README.md").read_text()
    assert "examples/my_rl_adapter.py" in readme and "examples.my_rl_adapter:make" in readme


def test_example_passes_the_contract_self_test():
    from examples.my_rl_adapter import make
    done = check_implementation(make(), "llama")
    assert "trainer" in done
    assert "trainer capabilities: TrainsRL, LogprobsWithGrad, DeclaresOptimizer" in done, done
    assert "implementation capabilities: none" in done, done


def test_example_declares_what_it_has(tmp_path):
    from examples.my_rl_adapter import make
    from fixtures.models.proxies import build_proxy
    impl = make()
    assert not any(isinstance(impl, c) for c in (HasKernelMode, ProvidesKernels, ChecksEngineKernels))
    trainer = impl.make_trainer(build_proxy("llama", "tiny", tmp_path / "p").path)
    try:
        assert isinstance(trainer, TrainsRL) and isinstance(trainer, LogprobsWithGrad)
        assert isinstance(trainer, DeclaresOptimizer) and trainer.optimizer_spec.name == "sgd"
        assert not isinstance(trainer, RecordsModuleOutputs)
        with pytest.raises(NotImplementedError):
            impl.make_engine(tmp_path)
    finally:
        trainer.close()


def _run_gates(report: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "--impl", "examples.my_rl_adapter:make", "--model=llama",
           "--upto", "C9", f"--report={report}", "--hypothesis-profile", "ci", "-q", "-p", "no:warnings"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert (report / "report.json").exists(), f"no report (exit {proc.returncode}):\n{out[-4000:]}"
    for bad in ("AttributeError", "TypeError"):
        assert bad not in out, f"{bad} in the run's output:\n{out[-4000:]}"
    return json.loads((report / "report.json").read_text())


def test_the_gates_run_on_the_example(tmp_path):
    """`pytest -n 2 --impl examples.my_rl_adapter:make --model=llama --upto C9` (about 50 s on 2
    cores): every gate passes, or is incomplete (nothing could run: the capability it lacks named) or
    blocked by such a gate - never a green by absence."""
    doc = _run_gates(tmp_path / "report")
    checks = doc["checks"]
    assert checks and {c["outcome"] for c in checks} <= {"passed", "skipped"}, \
        [(c["nodeid"], c["outcome"], c["reason"][:200]) for c in checks if c["outcome"] not in ("passed", "skipped")]
    verdicts = {g: doc["gates"][g]["models"]["llama"] for g in GATES}
    for gate, v in verdicts.items():
        assert v["status"] in ("pass", "incomplete", "blocked"), (gate, v["status"], v["reason"])
        assert not v["failed"], (gate, v["failed"])
        mine = [c for c in checks if c["gate"] == gate and c["outcome"] == "skipped"]
        for c in mine:      # every skip says why: n/a (a capability, a feature), or the hardware
            assert c["reason"].startswith(("n/a", "no CUDA", "inconclusive")), (c["nodeid"], c["reason"])
        if v["status"] == "incomplete":
            assert any(c["reason"].startswith("n/a") for c in mine), (gate, v["reason"])
        if v["status"] == "blocked":
            by = v["reason"].split(":")[0].removeprefix("blocked by ")
            assert verdicts[by]["status"] == "incomplete", (gate, v["reason"])
    expected = {"C0": "pass", "C1": "pass", "C2": "incomplete", "C3": "incomplete", "C4": "incomplete",
                "C5": "incomplete", "C6": "blocked", "C7": "incomplete", "C8": "blocked", "C9": "incomplete"}
    assert {g: v["status"] for g, v in verdicts.items()} == expected
    # the n/a reasons name the capability the example lacks
    assert any("not HasKernelMode" in n for n in verdicts["C0"]["notes"]), verdicts["C0"]["notes"]
    assert "not ProvidesKernels" in verdicts["C2"]["reason"], verdicts["C2"]["reason"]
    assert "no engine" in verdicts["C9"]["reason"], verdicts["C9"]["reason"]
    # what it has ran and passed: its trainer's invariance (C6) and backward (C8) checks
    for gate in ("C6", "C8"):
        n = verdicts[gate]["counts"].get("passed", 0)
        assert n > 0 and verdicts[gate]["label"] == f"blocked by C2 (own checks {n}/{n} pass)", verdicts[gate]["label"]


def test_the_contract_self_test_is_a_command():
    """`python -m fixtures.checks.selftest --impl X --model M`: what was checked on stdout, exit 0;
    a bad --impl or --model is one line and exit 4 (#45: it was reachable only through python -c)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    run = lambda *a: subprocess.run([sys.executable, "-m", "fixtures.checks.selftest", *a], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=300)
    ok = run("--impl", "examples.my_rl_adapter:make", "--model", "llama")
    assert ok.returncode == 0 and "trainer capabilities: TrainsRL, LogprobsWithGrad" in ok.stdout, ok.stderr[-2000:]
    for args, needle in ((("--impl", "nope:make", "--model", "llama"), "cannot import module 'nope'"),
                         (("--impl", "reference", "--model", "/nonexistent"), "no such directory")):
        bad = run(*args)
        errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("ERROR:")]
        assert bad.returncode == 4 and len(errors) == 1 and needle in errors[0], bad.stderr[-2000:]
        assert "Traceback" not in bad.stderr
