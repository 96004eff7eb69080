"""The adapter self-test: the reference implementation passes it; broken adapters are named."""
from __future__ import annotations

import pytest
import torch

from fixtures.core.contract import ContractError
from fixtures.models.proxies import build_proxy
from fixtures.reference.implementation import ReferenceImplementation
from fixtures.checks.selftest import check_implementation


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_proxy("llama", "tiny", tmp_path_factory.mktemp("llama")).path


def test_reference_passes_the_contract(llama_dir):
    assert "trainer" in check_implementation(ReferenceImplementation(), llama_dir)


class _Float64Trainer:
    """A user's trainer with a classic bug: logprobs returned in float64."""

    def __init__(self, inner):
        self.inner, self.name = inner, "float64-trainer"

    def logprobs(self, seqs, **kw):
        return [lp.double() for lp in self.inner.logprobs(seqs, **kw)]

    def module(self):
        return self.inner.module()

    def export_weights(self):
        return self.inner.export_weights()

    def close(self):
        self.inner.close()


class _RenamedWeightsTrainer(_Float64Trainer):
    def logprobs(self, seqs, **kw):
        return self.inner.logprobs(seqs, **kw)

    def export_weights(self):
        return {"fused." + k: v for k, v in self.inner.export_weights().items()}


@pytest.mark.parametrize("wrapper, message", [
    (_Float64Trainer, "expected float32 logprobs, got torch.float64"),
    (_RenamedWeightsTrainer, "names differ from the checkpoint's"),
])
def test_broken_adapters_are_named(llama_dir, wrapper, message):
    class Broken(ReferenceImplementation):
        def make_trainer(self, model_dir):
            return wrapper(super().make_trainer(model_dir))
    with pytest.raises(ContractError, match=message):
        check_implementation(Broken(), llama_dir)


def test_user_adapter_loads_through_impl_option():
    from fixtures.core.loader import load_implementation
    impl = load_implementation("fixtures.reference.implementation:ReferenceImplementation")
    assert impl.name == "reference" and impl.dtype() == torch.float32
