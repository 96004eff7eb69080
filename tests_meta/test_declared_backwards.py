"""C8 for a trainer without a kernel mode, op by op (fixtures.checks.declared_backwards): the
engine-kernel trainer's declared references pass, and so do the module-built trainer's
(fixtures.vllm.module_wrap: Gemma's norm, MulAndSilu, GeluAndMul, embedding, cached rotary, the
logits processor, linear with bias, MoE with its router GEMM); each planted wrong reference is caught; the
trainer differentiates exactly what it declares; and a real C8 run on it (CPU, ReferenceOps) runs
the declared checks and reads the reference mode's per-op cases n/a - never a TypeError."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fixtures.checks import declared_backwards as DB
from fixtures.checks.declared_ops import DECLARED_OPS, PLANTED_REFERENCES
from fixtures.checks.grad_cases import GradShape
from fixtures.models.proxies import build_proxy
from fixtures.vllm import module_wrap as MW
from fixtures.vllm import trainer as VT
from fixtures.vllm import trainer_ops as VO

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [*DB.PINNED_SHAPES, GradShape(rows=33, width=17, out=16, inner=3, seed=5),
          GradShape(rows=100, width=64, out=8, inner=2, seed=7)]


DECLARERS = {"trainer_ops": VO.BACKWARD_REFERENCES, "module_wrap": MW.REFERENCES}
"""The suite's trainers that declare reference backwards: the engine-kernel trainer's ops and the
module-built trainer's (fixtures.vllm.module_wrap: vLLM's own modules)."""


def test_every_op_has_a_planted_reference_and_a_trainer_declares_every_op():
    assert set(PLANTED_REFERENCES) == set(DECLARED_OPS)
    for who, refs in DECLARERS.items():
        assert not DB.unknown_ops(refs), (who, DB.unknown_ops(refs))
    assert set(VO.BACKWARD_REFERENCES) | set(MW.REFERENCES) == set(DECLARED_OPS)
    assert DB.unknown_ops({"linear": None, "rms_nrom": None}) == ["rms_nrom"]


@pytest.mark.parametrize("who, op", [(w, op) for w, refs in DECLARERS.items() for op in sorted(refs)])
def test_declared_references_are_within_the_bound(who, op):
    for shape in SHAPES:
        rep = DB.assert_declared_within_bound(op, DECLARERS[who][op], shape)
        assert rep.inputs and rep.max_ratio <= 1


@pytest.mark.parametrize("op", sorted(DECLARED_OPS))
def test_planted_reference_is_caught_and_named(op):
    """Control: each planted slip exceeds the bound at every shape."""
    p = PLANTED_REFERENCES[op]
    for shape in SHAPES:
        rep = DB.check_planted_reference(op, shape)
        assert not rep.ok, f"{p.name} at {shape}\n{rep.message()}"
        with pytest.raises(DB.DeclaredBackwardViolation) as info:
            DB.assert_declared_within_bound(op, p.fn, shape)
        msg = str(info.value)
        assert f"C8 declared backward: {op}" in msg and "VIOLATED" in msg and "ULP" in msg and "repro:" in msg, msg
        assert "elements over the bound" in msg and sum(r.count_over for r in rep.inputs) > 0, msg


@pytest.mark.parametrize("returned", [None, ["linear"], {"linear": 3}, {1: VO.ref_linear}])
def test_a_malformed_declaration_is_a_contract_error(returned):
    from types import SimpleNamespace
    from fixtures.core.contract import ContractError
    with pytest.raises(ContractError, match=r"backward_references\(\) returned .*expected a mapping"):
        DB.declared_references(SimpleNamespace(backward_references=lambda: returned))


def test_a_missing_gradient_counts_as_zero():
    """A declared function that cuts an input out of the graph (no gradient at all) is a violation
    at that input, reported as such."""
    rep = DB.check_planted_reference("moe", SHAPES[2])
    router = next(r for r in rep.inputs if r.name == "router_logits")
    assert router.missing and not router.ok and "no gradient: None" in rep.message()


def test_a_nondeterministic_backward_is_caught():
    calls = iter(range(100))

    def drifting(x, w):            # the second backward differs in one ULP somewhere
        y = VO.ref_linear(x, w)
        return y * (1 + 2.0 ** -23) if next(calls) % 2 else y
    from fixtures.core.comparison import BitwiseMismatch
    with pytest.raises(BitwiseMismatch, match="run to run"):
        DB.check_declared("linear", drifting, SHAPES[3])


@pytest.mark.parametrize("model, op", [("qwen3", "silu_and_mul"), ("qwen3_moe", "moe")])
def test_the_trainer_differentiates_what_it_declares(model, op, tmp_path, monkeypatch):
    """Swapping one entry of BACKWARD_REFERENCES for its planted slip changes the trainer's
    gradients and not its forward bits: the declared functions are the ones its backward runs."""
    path = build_proxy(model, "tiny", tmp_path / model, seed=3).path
    trainer = VT.EngineKernelTrainer(path, VO.ReferenceOps, dtype=torch.float32, device="cpu")
    seqs = [[5, 17, 3, 99, 250, 7, 8], [1, 2, 40, 41]]

    def run():
        trainer.module().zero_grad(set_to_none=True)
        lps = trainer.logprobs_with_grad(seqs)
        (-torch.cat(lps).mean()).backward()
        return torch.cat([lp.detach() for lp in lps]), {n: p.grad.clone() for n, p in trainer.module().named_parameters()
                                                        if p.grad is not None}
    lp, grads = run()
    assert trainer.backward_references()[op] is VO.BACKWARD_REFERENCES[op]
    monkeypatch.setitem(VO.BACKWARD_REFERENCES, op, PLANTED_REFERENCES[op].fn)
    assert trainer.backward_references()[op] is PLANTED_REFERENCES[op].fn
    lp2, grads2 = run()
    assert torch.equal(lp, lp2)
    assert any(not torch.equal(grads[n], grads2.get(n, torch.zeros_like(grads[n]))) for n in grads)


IMPL = textwrap.dedent('''
    """The engine-kernel trainer on the CPU (ReferenceOps, float32), under no kernel mode."""
    from fixtures.reference.implementation import ReferenceImplementation
    from fixtures.vllm.trainer import EngineKernelTrainer
    from fixtures.vllm.trainer_ops import ReferenceOps


    class EngineKernelCPU(ReferenceImplementation):
        kernel_mode = None          # not HasKernelMode: the trainer's backward is its own

        def make_trainer(self, model_dir):
            return EngineKernelTrainer(model_dir, ReferenceOps, dtype=__import__("torch").float32, device="cpu")


    def make():
        return EngineKernelCPU()
''')


def test_c8_runs_the_declared_checks_on_a_trainer_without_a_kernel_mode(tmp_path):
    """`pytest -m C8 --impl <engine-kernel trainer on the CPU>` (the per-op part, about 20 s): the
    declared checks and their controls pass, the reference mode's per-op cases are n/a naming
    HasKernelMode, and nothing errors."""
    (tmp_path / "ek_cpu_impl.py").write_text(IMPL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "pytest", "--impl", "ek_cpu_impl:make", "--model=qwen3", "-m", "C8",
           "-k", "declared or grad_within_bound or planted_backward", f"--report={report}",
           "--hypothesis-profile", "ci", "-q", "-p", "no:warnings", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (report / "report.json").exists(), out[-4000:]
    checks = json.loads((report / "report.json").read_text())["checks"]
    by = {c["nodeid"].split("::")[-1].replace("[qwen3-", "[").replace("[qwen3]", ""): c for c in checks}
    for op in DECLARED_OPS:
        for name in (f"test_declared_backward_within_bound[{op}]", f"test_planted_declared_backward_exceeds_bound[{op}]"):
            if op in VO.BACKWARD_REFERENCES:
                assert by[name]["outcome"] == "passed", (name, by[name]["reason"][:300])
            else:           # an op only the module-built trainer declares
                assert by[name]["outcome"] == "skipped" and by[name]["kind"] == "n/a", (name, by[name]["outcome"])
    assert by["test_declared_backwards_are_known_ops"]["outcome"] == "passed"
    per_op = [c for n, c in by.items() if n.startswith(("test_grad_within_bound", "test_planted_backward_exceeds"))]
    assert per_op and all(c["outcome"] == "skipped" and c["kind"] == "n/a"
                          and c["properties"].get("capability") == "HasKernelMode"
                          for c in per_op), [(c["nodeid"], c["outcome"], c["reason"][:120]) for c in per_op]
    assert "TypeError" not in out
