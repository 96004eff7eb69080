"""The engine gates' example budget follows the proxy size: full-depth runs draw a bounded number
of hypothesis examples per engine property (fixtures.checks.workloads.ENGINE_EXAMPLE_CAPS), set
here because the gate modules fix their hypothesis settings when they are imported."""
from fixtures.checks.workloads import set_proxy_size


def pytest_configure(config):
    set_proxy_size(config.getoption("--proxy", None))
