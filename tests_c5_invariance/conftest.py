"""The engine gates' example budget follows the proxy size: full-depth runs draw a bounded number
of hypothesis examples per engine property (fixtures.checks.workloads.ENGINE_EXAMPLE_CAPS), set
here because the gate modules fix their hypothesis settings when they are imported."""
import pytest

from fixtures.checks.workloads import set_proxy_size


def pytest_configure(config):
    set_proxy_size(config.getoption("--proxy", None))


@pytest.fixture(scope="module")
def lazy_trainer(request):
    """The trainer, built only when a failing check's logprob-convention diagnosis asks for it
    (does the engine's prefill equal the trainer? recompute from the trainer's rows): a green
    engine gate builds none, and one that cannot be built leaves the diagnosis to the engine."""
    def get():
        try:
            return request.getfixturevalue("trainer")
        except (Exception, pytest.skip.Exception, pytest.fail.Exception):    # n/a or broken: diagnose without it
            return None
    return get


@pytest.fixture(scope="module")
def engine_library(impl):
    """The engine's own kernels as the implementation hands them over (ChecksEngineKernels), else
    n/a: the GPU-lane C2 modules' common start."""
    from fixtures.core.contract import ChecksEngineKernels
    from fixtures.core.outcomes import not_applicable
    if not isinstance(impl, ChecksEngineKernels):
        not_applicable(f"the implementation is not ChecksEngineKernels (the engine's own kernels are checked with "
                       f"--impl vllm; this run: {impl.name})", capability=ChecksEngineKernels)
    return impl.engine_kernel_library()
