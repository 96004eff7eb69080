"""The vLLM adapter's knobs (--vllm-attention-backend, --vllm-compiled-custom-ops, --vllm-fixes,
and the performance-only ones as --vllm-runtime KEY=VALUE,...): a setting is exported to the
environment variable the adapter reads, the variable alone is the fallback, the two disagreeing is
one usage error, as is an unknown runtime key; every one set is echoed in the header and the
report. And the repro command of a failure passes the run's options again (--impl, --model,
--proxy, --proxy-seed, --proxy-weights, the vLLM options, --hypothesis-profile)."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from fixtures.core import environment
from fixtures.plugin.options import VLLM_KNOBS

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

# The inner suite's one check writes what it saw: the knobs' environment and its repro command.
PROBE = """
import json, os, pytest
from fixtures.core import environment
@pytest.mark.C0
def test_probe():
    names = {names!r}
    seen = {{"env": {{n: os.environ.get(n) for n in names}}, "repro": environment.repro_command()}}
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(seen, f)
"""


@pytest.fixture
def inner(pytester, monkeypatch, tmp_path):
    """An in-process run of the plugin on one probe check; returns (result, what the check saw).
    No knob is set around it, and the module-level state it changes is put back."""
    from hypothesis import settings
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    for knob in VLLM_KNOBS:
        monkeypatch.delenv(knob.env, raising=False)
    probe = tmp_path / "probe.json"
    monkeypatch.setenv("PROBE_OUT", str(probe))
    (pytester.path / "tests_c0_inventory").mkdir()
    (pytester.path / "tests_c0_inventory" / "test_probe.py").write_text(
        PROBE.format(names=[k.env for k in VLLM_KNOBS]))
    saved_env, saved_profile = dict(environment._session), settings._current_profile

    def run(*args):
        if probe.exists():
            probe.unlink()
        res = pytester.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama",
                                           "-p", "no:cacheprovider", *args)
        return res, (json.loads(probe.read_text()) if probe.exists() else None)
    yield run
    environment._session.update(saved_env)
    if saved_profile:
        settings.load_profile(saved_profile)


def _plugins_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytest_plugins" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_every_hook_module_is_a_registered_plugin():
    """A hook in a module pytest never registers is silently dead: every module of fixtures/ that
    defines a pytest_* hook is in conftest.py's pytest_plugins (path_options: a pytest11 entry
    point), and `-p fixtures.plugin.session` alone pulls in the plugin's other hook modules."""
    hooks = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "fixtures").rglob("*.py")
             if any(isinstance(n, ast.FunctionDef) and n.name.startswith("pytest_")
                    for n in ast.parse(p.read_text()).body)}
    assert hooks - set(_plugins_of(ROOT / "conftest.py")) == {"fixtures.plugin.path_options"}
    pulled = set(_plugins_of(ROOT / "fixtures" / "plugin" / "session.py"))
    assert hooks - pulled == {"fixtures.plugin.session", "fixtures.plugin.faults", "fixtures.plugin.path_options"}


def test_every_knob_the_adapter_reads_is_an_option_and_echoed():
    """Every CONFORMANCE_VLLM_* variable fixtures/vllm reads (but the fake backend's, which the
    adapter sets for its own worker) has a --vllm-* option or a --vllm-runtime key, echoed in the
    header's environment; the options and the runtime keys are listed in docs/options.md, the
    options in the README; only the performance-only knobs are runtime keys."""
    read = {m for p in (ROOT / "fixtures" / "vllm").glob("*.py")
            for m in re.findall(r"CONFORMANCE_VLLM_[A-Z_]+", p.read_text())} - {"CONFORMANCE_VLLM_FAKE"}
    assert read == {k.env for k in VLLM_KNOBS}
    assert all(k.name == k.env[len("CONFORMANCE_VLLM_"):].lower().replace("_", "-") for k in VLLM_KNOBS)
    assert {k.env for k in VLLM_KNOBS} <= set(environment.RELEVANT_ENV)
    assert {k.name for k in VLLM_KNOBS if not k.runtime} == {"attention-backend", "compiled-custom-ops", "fixes",
                                                                   "quantization"}
    readme, options = (ROOT / "README.md").read_text(), (ROOT / "docs" / "options.md").read_text()
    assert [k.flag for k in VLLM_KNOBS if not k.runtime and f"`{k.flag}" not in readme + options] == []
    assert "`--vllm-runtime" in readme
    assert [k.name for k in VLLM_KNOBS if k.runtime and f"`{k.name}=" not in options] == []


def test_an_option_is_exported_echoed_and_put_back(inner, pytester):
    res, seen = inner("--vllm-runtime", "idle-engines=3", "--vllm-attention-backend=TRITON_ATTN",
                      "--vllm-runtime=log-dir=logs", "--report=rep")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    logs = str(pytester.path / "logs")
    assert seen["env"]["CONFORMANCE_VLLM_IDLE_ENGINES"] == "3"
    assert seen["env"]["CONFORMANCE_VLLM_ATTENTION_BACKEND"] == "TRITON_ATTN"
    assert seen["env"]["CONFORMANCE_VLLM_LOG_DIR"] == logs          # absolute: workers may run elsewhere
    assert seen["env"]["CONFORMANCE_VLLM_PRESPAWN"] is None          # an absent knob stays unset
    out = res.stdout.str()
    assert (f"conformance vllm options: --vllm-attention-backend=TRITON_ATTN "
            f"--vllm-runtime=idle-engines=3,log-dir={logs}") in out
    assert "CONFORMANCE_VLLM_IDLE_ENGINES=3" in out                  # the header's environment line
    doc = json.loads((pytester.path / "rep" / "report.json").read_text())
    assert doc["environment"]["env"]["CONFORMANCE_VLLM_IDLE_ENGINES"] == "3"
    assert "`CONFORMANCE_VLLM_ATTENTION_BACKEND=TRITON_ATTN`" in (pytester.path / "rep" / "report.md").read_text()
    assert not any(k.env in os.environ for k in VLLM_KNOBS), "the run left a knob in its caller's environment"


def test_the_variable_alone_is_the_fallback(inner, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_CALL_TIMEOUT", "120")
    res, seen = inner()
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert seen["env"]["CONFORMANCE_VLLM_CALL_TIMEOUT"] == "120"
    assert "conformance vllm options: --vllm-runtime=call-timeout=120 (from CONFORMANCE_VLLM_CALL_TIMEOUT)" \
        in res.stdout.str()
    assert "--vllm-runtime=call-timeout=120" in shlex.split(seen["repro"])
    assert os.environ["CONFORMANCE_VLLM_CALL_TIMEOUT"] == "120"       # a variable the run did not set, kept


def test_the_same_value_both_ways_is_accepted(inner, monkeypatch):
    monkeypatch.setenv("CONFORMANCE_VLLM_START_TIMEOUT", "900")
    monkeypatch.setenv("CONFORMANCE_VLLM_COMPILED_CUSTOM_OPS", "all")
    res, seen = inner("--vllm-runtime", "start-timeout=900.0", "--vllm-compiled-custom-ops", "all")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert seen["env"]["CONFORMANCE_VLLM_START_TIMEOUT"] == "900"
    assert os.environ["CONFORMANCE_VLLM_START_TIMEOUT"] == "900"     # put back as the caller had it


@pytest.mark.parametrize("option, env, needles", [
    (["--vllm-runtime", "idle-engines=3"], {"CONFORMANCE_VLLM_IDLE_ENGINES": "1"},
     ["--vllm-runtime idle-engines=3 and CONFORMANCE_VLLM_IDLE_ENGINES=1 disagree"]),
    (["--vllm-attention-backend=TRITON_ATTN"], {"CONFORMANCE_VLLM_ATTENTION_BACKEND": "FLASH_ATTN"},
     ["--vllm-attention-backend=TRITON_ATTN and CONFORMANCE_VLLM_ATTENTION_BACKEND=FLASH_ATTN disagree"]),
    (["--vllm-runtime", "idle-engines=many"], {}, ["--vllm-runtime idle-engines=many: expected a whole number >= 0"]),
    (["--vllm-runtime=recycle=1,prespawn=yes"], {}, ["--vllm-runtime prespawn=yes: expected 0 or 1"]),
    (["--vllm-runtime=idle-engine=2"], {}, ["--vllm-runtime=idle-engine=2: unknown key 'idle-engine' (keys: idle-engines,"]),
    (["--vllm-runtime=prespawn"], {}, ["--vllm-runtime=prespawn: 'prespawn' is not KEY=VALUE"]),
    (["--vllm-runtime=prespawn=0", "--vllm-runtime=prespawn=1"], {}, ["--vllm-runtime: prespawn given twice"]),
    (["--vllm-runtime=fixes=all"], {}, ["unknown key 'fixes'"]),
    (["--vllm-quantization=int8"], {}, ["--vllm-quantization=int8: unknown quantization 'int8': expected fp8"]),
    (["--vllm-quantization=fp8"], {"CONFORMANCE_VLLM_QUANTIZATION": "none"},
     ["--vllm-quantization=fp8 and CONFORMANCE_VLLM_QUANTIZATION=none disagree"]),
    ([], {"CONFORMANCE_VLLM_CALL_TIMEOUT": "soon"}, ["CONFORMANCE_VLLM_CALL_TIMEOUT=soon: expected a number of seconds"]),
])
def test_disagreeing_or_bad_values_are_one_usage_error(inner, monkeypatch, option, env, needles, one_error_line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res, seen = inner(*option)
    line = one_error_line(res)
    assert seen is None and all(n in line for n in needles), line
    assert {k.env: os.environ.get(k.env) for k in VLLM_KNOBS if k.env in os.environ} == env, \
        "nothing is exported when a knob is refused"


def test_a_performance_knob_is_no_option_of_its_own(inner):
    """The performance-only knobs are --vllm-runtime keys: their old options are unknown to pytest."""
    res, _ = inner("--vllm-idle-engines=3")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "unrecognized arguments: --vllm-idle-engines=3" in res.stderr.str()


def test_the_repro_command_passes_the_options_again(inner):
    res, seen = inner("--vllm-runtime=idle-engines=0", "--proxy-seed", "7", "--hypothesis-profile", "ci")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    argv = shlex.split(seen["repro"])
    assert argv[:2] == ["pytest", "tests_c0_inventory/test_probe.py::test_probe"]
    assert argv[2:] == ["--impl=reference", "--model=llama", "--proxy=tiny", "--proxy-seed=7",
                        "--proxy-weights=files", "--vllm-runtime=idle-engines=0", "--hypothesis-profile=ci"]


def test_the_repro_command_narrows_model_to_the_running_test(monkeypatch):
    monkeypatch.setattr(environment, "_session", {"impl": {}, "argv": [], "options": {
        "--impl": "reference", "--model": ["llama", "/models/my qwen"], "--proxy": "tiny", "--proxy-seed": 0,
        "--strict": True, "--absent": None}})
    monkeypatch.setattr(environment, "_current", {"nodeid": "t.py::test[my qwen]", "params": {"model": "/models/my qwen"}})
    assert shlex.split(environment.repro_command()) == \
        ["pytest", "t.py::test[my qwen]", "--impl=reference", "--model=/models/my qwen", "--proxy=tiny",
         "--proxy-seed=0", "--strict"]
    monkeypatch.setattr(environment, "_current", {"nodeid": "t.py::test_all", "params": {"model": None}})
    assert shlex.split(environment.repro_command())[2:5] == \
        ["--impl=reference", "--model=llama", "--model=/models/my qwen"]    # a model-independent check: every model


def test_workers_see_the_option_and_accept_the_inherited_variable(inner):
    """Under xdist the workers inherit the variable the controller exported and parse the same
    option: equal, so accepted; each worker's check sees the value."""
    pytest.importorskip("xdist")
    res, seen = inner("-n", "2", "--vllm-runtime=prespawn=0")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert seen["env"]["CONFORMANCE_VLLM_PRESPAWN"] == "0"
    assert "--vllm-runtime=prespawn=0" in shlex.split(seen["repro"])
    assert "CONFORMANCE_VLLM_PRESPAWN" not in os.environ


def test_torch_threads_are_the_cores_shared_among_the_workers(monkeypatch):
    """--cpu-threads unset: 1 on the CPU lane; on an accelerator lane the usable cores over the
    xdist workers (16 cores, -n 4: 4 - not torch's 16 in each of 4 workers); set: what was asked
    (0: torch's default). Control: a lone process on the GPU lane gets every core."""
    from fixtures.plugin.session import cpu_threads

    class Option:
        numprocesses = None

    class Config:
        option = Option()
        asked = None

        def getoption(self, name):
            assert name == "--cpu-threads"
            return self.asked
    config = Config()
    monkeypatch.setattr(environment, "usable_cores", lambda: 16)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert cpu_threads(config, "cpu") == 1
    assert cpu_threads(config, "cuda:0") == 4
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    config.option.numprocesses = 3                       # the controller of -n 3
    assert cpu_threads(config, "cuda") == 5
    config.option.numprocesses = None
    assert cpu_threads(config, "cuda") == 16             # control: alone, every core
    config.asked = 2
    assert cpu_threads(config, "cuda") == 2 and cpu_threads(config, "cpu") == 2
    config.asked = 0
    assert cpu_threads(config, "cuda") == 0


def test_a_large_cpu_job_borrows_the_cores_the_other_workers_leave(monkeypatch):
    """C8's float64 reference on the CPU: the cores less one for each other worker, then back."""
    import torch
    before = torch.get_num_threads()
    monkeypatch.setattr(environment, "usable_cores", lambda: 16)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    with environment.borrowed_cpu_threads() as threads:
        assert threads == 13 and torch.get_num_threads() == 13
    assert torch.get_num_threads() == before
    torch.set_num_threads(20)
    try:
        with environment.borrowed_cpu_threads() as threads:  # never fewer than the process had
            assert threads == 20
    finally:
        torch.set_num_threads(before)


def _registered_flags() -> list[str]:
    """The long flags the suite's own pytest_addoption hooks register (its groups "conformance"
    and "conformance-vllm"), read by calling the hooks on a recording parser: nothing starts."""
    from fixtures.plugin import faults, options
    flags: list[str] = []

    class Recorder:
        def getgroup(self, *args, **kwargs):
            return self

        def addoption(self, *names, **kwargs):
            flags.extend(n for n in names if n.startswith("--"))

    for hook in (options.pytest_addoption, faults.pytest_addoption):
        hook(Recorder())
    return flags


def test_docs_options_lists_every_registered_option_and_no_other():
    """docs/options.md is the page behind `pytest --help`: every option the suite registers has
    its row there (a new option without one fails here), and the page's table lists no option
    the suite does not register (a renamed or removed one)."""
    flags = _registered_flags()
    assert len(flags) == len(set(flags)) and "--records" in flags and "--impl" in flags
    page = (ROOT / "docs" / "options.md").read_text()
    rows = {m for m in re.findall(r"^\| `(--[a-z][a-z0-9-]*)", page, re.M)}
    assert sorted(set(flags) - rows) == [], "registered but not in docs/options.md's table"
    # --hypothesis-profile is hypothesis' own option, documented here for the profiles the suite adds
    assert sorted(rows - set(flags) - {"--hypothesis-profile"}) == [], "in docs/options.md but not registered"
