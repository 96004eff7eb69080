"""The logprob-convention diagnosis (fixtures.diagnose.conventions), the full-vocabulary rows
(fixtures.core.full_rows; vLLM's through the fake worker, fixtures.vllm.full_rows) and the step a
mechanism failure is named at (fixtures.diagnose.engine_rows.step_of_token): each answer seen
right, and each seen to refuse what it must refuse (a hypothesis that does not fit is not named)."""
from __future__ import annotations

import json
from collections import namedtuple

import pytest
import torch

from fixtures.core.contract import ContractError, SamplingParams
from fixtures.core.full_rows import ReturnsFullVocabLogprobs, check_full_rows, sample_positions
from fixtures.core.traces import RequestTrace
from fixtures.diagnose import conventions as conv
from fixtures.diagnose.engine_rows import step_of_token


def _rows(n=6, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, vocab, generator=g) * 3, -1)


def _reported(rows, tokens, **how):
    return conv.processed_rows(rows, **how).gather(-1, torch.tensor(tokens)[:, None])[:, 0].float()


TOKENS = [3, 17, 0, 42, 8, 25]


@pytest.mark.parametrize("how, params, name", [
    ({}, SamplingParams(temperature=0.7), conv.RAW),
    ({"temperature": 0.7}, SamplingParams(temperature=0.7), conv.TEMPERATURE),
    ({"top_k": 5}, SamplingParams(temperature=1.0, top_k=5), conv.TRUNCATED),
    ({"temperature": 1.3, "top_p": 0.8}, SamplingParams(temperature=1.3, top_p=0.8), conv.PROCESSED),
])
def test_the_convention_that_made_the_numbers_is_named(how, params, name):
    rows = _rows()
    tokens = [int(torch.argsort(r, descending=True)[i % 3]) for i, r in enumerate(rows)]   # inside any top-k/p set
    verdict = conv.explain(_reported(rows, tokens, **how), tokens, rows, params)
    assert verdict.name == name, verdict.describe()
    if name != conv.RAW:
        assert "(processed) logprobs where raw were asked" in verdict.describe()


def test_numbers_no_convention_explains_are_not_given_one():
    """Negative control: values off by far more than any recomputation error fit no hypothesis."""
    rows = _rows()
    off = _reported(rows, TOKENS) - 0.05
    verdict = conv.explain(off, TOKENS, rows, SamplingParams(temperature=0.7))
    assert verdict.name is None and "no logprob convention explains" in verdict.describe()


def test_only_the_parameters_in_force_are_hypotheses():
    assert list(conv.hypotheses(SamplingParams(temperature=1.0))) == [conv.RAW]
    assert list(conv.hypotheses(None)) == [conv.RAW]
    assert conv.TEMPERATURE in conv.hypotheses(SamplingParams(temperature=0.6))


def test_without_rows_the_diagnosis_says_why():
    text = conv.diagnose_sequence(object(), None, [1, 2, 3, 4], 1, torch.tensor([-1.0, -2.0]),
                                  SamplingParams(temperature=0.7))
    assert "neither the trainer nor the engine is ReturnsFullVocabLogprobs" in text


def test_sample_positions_are_seeded_and_keep_the_last():
    a = sample_positions([10, 30, 3], 3, seed=5, starts=[4, 20, 1])
    assert a == sample_positions([10, 30, 3], 3, seed=5, starts=[4, 20, 1])
    assert all(ps[-1] == n - 2 and all(p >= s for p in ps) for ps, n, s in zip(a, [10, 30, 3], [4, 20, 1]))
    assert [len(ps) for ps in a] == [3, 3, 1]


def test_full_rows_breaches_are_named():
    with pytest.raises(ContractError, match=r"expected \[2, vocab\]"):
        check_full_rows(torch.zeros(3, 10), sequence=[1, 2, 3], positions=[0, 1], what="rows")
    with pytest.raises(ContractError, match="cannot hold token 12"):
        check_full_rows(torch.zeros(1, 10), sequence=[1, 12], positions=[0], what="rows")
    with pytest.raises(ContractError, match="float32"):
        check_full_rows(torch.zeros(1, 10, dtype=torch.float64), sequence=[1, 2], positions=[0], what="rows")


def test_step_of_token_names_the_step_after_a_preemption():
    # a 5-token prompt in one step, two decode steps, preempted: prompt + 3 generated recomputed, then decode
    trace = RequestTrace(0, (5, 3, 3, 9, 4), (5, 1, 1, 8, 1))
    assert "sampled in step 1" in step_of_token(trace, 5, 1) and "no preemption" in step_of_token(trace, 5, 1)
    late = step_of_token(trace, 5, 3)
    assert "sampled in step 3" in late and "after a preemption's recompute in step(s) [3]" in late
    assert "no per-request trace" in step_of_token(None, 5, 0)


# ---------------------------------------------------------------------------------------------
# vLLM's rows: the conversion, and the fake worker through the real worker loop
# ---------------------------------------------------------------------------------------------
def test_vllm_row_conversion_needs_every_entry():
    from fixtures.vllm.full_rows import row_from_output, row_kwargs
    Lp = namedtuple("Logprob", "logprob rank decoded_token")
    Out, ReqOut = namedtuple("Out", "logprobs"), namedtuple("ReqOut", "outputs")
    full = ReqOut([Out([{v: Lp(-1.0 - v, 1, None) for v in range(4)}])])
    assert torch.equal(row_from_output(full, 4, what="r"), torch.tensor([-1.0, -2.0, -3.0, -4.0]))
    short = ReqOut([Out([{v: Lp(-1.0, 1, None) for v in range(3)}])])
    with pytest.raises(ContractError, match="1 of 4 vocabulary entries missing"):
        row_from_output(short, 4, what="r")
    kw = row_kwargs()
    assert kw["logprobs"] == -1 and kw["flat_logprobs"] and kw["temperature"] == 0.0


def test_vllm_engine_rows_through_the_fake_worker(tmp_path):
    from fixtures.vllm import client as vclient
    from fixtures.vllm import settings as vset
    from fixtures.core.contract import EngineSettings
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 300, "eos_token_id": 7}))
    assert vset.llm_kwargs(d, EngineSettings())["max_logprobs"] == -1
    with vclient.VLLMEngine(d, fake="echo", log_dir=tmp_path) as eng:
        assert isinstance(eng, ReturnsFullVocabLogprobs)
        seqs = [[5, 9, 200, 3], [1, 2]]
        rows = eng.full_logprobs(seqs, [[0, 2], [0]])
        assert [tuple(r.shape) for r in rows] == [(2, 300), (1, 300)]
        prompt = eng.prompt_logprobs(seqs)
        for s, ps, r, lp in zip(seqs, [[0, 2], [0]], rows, prompt):    # row[next token] is the prompt logprob
            assert all(r[k, s[p + 1]] == lp[p] for k, p in enumerate(ps))
        with pytest.raises(Exception, match="has no next token"):
            eng.full_logprobs([[1, 2]], [[1]])


def test_reference_rows_hold_their_own_logprobs_and_a_shifted_row_is_refused(tmp_path):
    """The contract self-test of the rows (fixtures.checks.selftest.check_full_rows_agree) on the
    reference engine and trainer, and its negative control: rows one ULP off at the next token."""
    from fixtures.checks.selftest import check_full_rows_agree
    from fixtures.models.proxies import build_proxy
    from fixtures.reference.implementation import ReferenceImplementation
    d = build_proxy("llama", "tiny", tmp_path).path
    impl = ReferenceImplementation()
    seq = list(range(1, 9))
    trainer = impl.make_trainer(d)
    with impl.make_engine(d) as engine:
        for who, obj, lps in (("engine", engine, engine.prompt_logprobs([seq])[0]),
                              ("trainer", trainer, trainer.logprobs([seq])[0])):
            assert isinstance(obj, ReturnsFullVocabLogprobs)
            check_full_rows_agree(obj, seq, lps, who)

    class Shifted:
        def full_logprobs(self, sequences, positions):
            return [torch.nextafter(r, torch.zeros_like(r)) for r in trainer.full_logprobs(sequences, positions)]
    with pytest.raises(ContractError, match="row\\[next token\\]"):
        check_full_rows_agree(Shifted(), seq, trainer.logprobs([seq])[0], "shifted")
    trainer.close()


def test_a_diagnosis_never_hides_the_failure():
    from fixtures.core.comparison import BitwiseMismatch, assert_bitwise, shrinking
    assert not shrinking()                     # outside hypothesis every failure is diagnosed
    with pytest.raises(BitwiseMismatch, match=r"diagnosis: \(diagnosis failed: ZeroDivisionError"):
        assert_bitwise(torch.tensor([1.0]), torch.tensor([2.0]), diagnose=lambda d: 1 / 0)
    with pytest.raises(BitwiseMismatch, match="diagnosis: first at token 0"):
        assert_bitwise(torch.tensor([1.0]), torch.tensor([2.0]), diagnose=lambda d: f"first at token {d.first[1]}")
