"""The environment an implementation needs in the pytest process itself (ConfiguresProcess; for
vLLM's engine-kernel trainer VLLM_BATCH_INVARIANT=1, which vLLM reads when its kernels are
picked): the plugin sets it at configure time - before the gate modules are collected, in the
controller and in every xdist worker - echoes it in the header and the report, refuses a
contradicting export in one line, and puts the environment back afterwards. A user exports
nothing."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.core import contract as C
from fixtures.core import environment

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
A, B = "CONFORMANCE_SELFTEST_PROCESS_A", "CONFORMANCE_SELFTEST_PROCESS_B"
NAMES = (A, B, "VLLM_BATCH_INVARIANT")
FAKE = "fake_process_impl:make"

# A reference implementation that declares the capability; what it declares comes from
# FAKE_PROCESS_ENV (JSON), so one module serves every case (and the xdist workers inherit it).
FAKE_IMPL = '''
import json, os
from fixtures.reference.implementation import ReferenceImplementation

class Configured(ReferenceImplementation):
    name = "configured"

    def process_environment(self):
        return json.loads(os.environ["FAKE_PROCESS_ENV"])

def make():
    return Configured()
'''

# What the inner suite saw: at import (collection, on every xdist worker) and in its one check.
PROBE = '''
import json, os, pytest
from fixtures.core import environment

def _write(tag):
    seen = {n: os.environ.get(n) for n in os.environ["PROBE_NAMES"].split(",")}
    name = f"{tag}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json"
    with open(os.path.join(os.environ["PROBE_DIR"], name), "w") as f:
        json.dump({"env": seen, "repro": environment.repro_command()}, f)

_write("import")

@pytest.mark.C0
def test_probe():
    _write("test")
'''


@pytest.fixture
def inner(write_suite, monkeypatch, tmp_path):
    """run(*args, declares={...}) -> (result, {probe file stem: what it saw}): an in-process run
    of the plugin on the probe suite, with the fake implementation importable (here and in xdist
    workers). No probed variable is set around it; the module-level state it changes is put back."""
    from hypothesis import settings
    # an xdist worker starts with its controller's sys.path, not PYTHONPATH: the root conftest.py
    # (imported before pytest_configure, its directory prepended to sys.path) makes the fake importable
    pt = write_suite({"fake_process_impl.py": FAKE_IMPL, "conftest.py": "", "tests_c0_inventory/test_probe.py": PROBE})
    monkeypatch.syspath_prepend(str(pt.path))
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):   # the outer run's, under -n
        monkeypatch.delenv(name, raising=False)
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    probes = tmp_path / "probes"
    probes.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probes))
    monkeypatch.setenv("PROBE_NAMES", ",".join(NAMES))
    saved_env, saved_profile = dict(environment._session), settings._current_profile

    def run(*args, declares=None):
        monkeypatch.setenv("FAKE_PROCESS_ENV", json.dumps({A: "1", B: "off"} if declares is None else declares))
        for p in probes.iterdir():
            p.unlink()
        res = pt.runpytest_inprocess("-p", "fixtures.plugin.session", "--model", "llama", "-p", "no:cacheprovider",
                                     *args)
        return res, {p.stem: json.loads(p.read_text()) for p in probes.iterdir()}
    yield run
    environment._session.update(saved_env)
    if saved_profile:
        settings.load_profile(saved_profile)


def _left_over() -> dict:
    return {n: os.environ[n] for n in NAMES if n in os.environ}


# ---------------------------------------------------------------------------------------------
# through the plugin
# ---------------------------------------------------------------------------------------------
def test_set_before_collection_echoed_and_put_back(inner, write_suite):
    res, seen = inner("--impl", FAKE, "--report=rep")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    for tag in ("import-main", "test-main"):            # at collection already, and in the check
        assert seen[tag]["env"][A] == "1" and seen[tag]["env"][B] == "off", seen
    assert f"conformance process env: {A}=1 {B}=off (set by --impl {FAKE})" in res.stdout.str()
    rep = write_suite({}).path / "rep"
    doc = json.loads((rep / "report.json").read_text())
    assert doc["environment"]["process_env"] == {"set_by": f"--impl {FAKE}", "variables": {A: "1", B: "off"}}
    assert f"- set in the pytest process by --impl {FAKE}: `{A}=1`, `{B}=off`" in (rep / "report.md").read_text()
    assert _left_over() == {}, "the run left the implementation's variables in its caller's environment"


def test_an_implementation_that_declares_nothing_sets_nothing(inner):
    res, seen = inner("--impl", FAKE, declares={})
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert "conformance process env" not in res.stdout.str()
    assert seen["test-main"]["env"] == {n: None for n in NAMES}


def test_the_engine_kernel_preset_sets_vllm_batch_invariant(inner):
    """The real preset, loaded without vLLM: VLLM_BATCH_INVARIANT=1 in the process, not in the
    repro command (the suite sets it again there), and gone afterwards. (Its checks skip here: no
    CUDA; the probe's import still runs.)"""
    res, seen = inner("--impl", "vllm-engine-kernels")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert seen["import-main"]["env"]["VLLM_BATCH_INVARIANT"] == "1"
    assert ("conformance process env: VLLM_BATCH_INVARIANT=1 (set by --impl vllm-engine-kernels)"
            in res.stdout.str())
    assert shlex.split(seen["import-main"]["repro"])[0] == "pytest"
    assert _left_over() == {}


def test_the_reference_kernel_preset_sets_nothing(inner):
    res, seen = inner("--impl", "vllm")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert "conformance process env" not in res.stdout.str()
    assert seen["import-main"]["env"]["VLLM_BATCH_INVARIANT"] is None


def test_workers_set_it_too(inner):
    pytest.importorskip("xdist")
    res, seen = inner("-n", "2", "--impl", FAKE)
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    imports = {tag: s["env"] for tag, s in seen.items() if tag.startswith("import-")}
    assert set(imports) == {"import-gw0", "import-gw1"}, seen      # every worker collects the module
    assert all(env[A] == "1" and env[B] == "off" for env in imports.values()), imports
    assert f"conformance process env: {A}=1 {B}=off (set by --impl {FAKE})" in res.stdout.str()
    assert _left_over() == {}


@pytest.mark.parametrize("impl, exported, needles", [
    (FAKE, {A: "0"}, [f"{A}=0 is exported, but --impl {FAKE} needs {A}=1 in the pytest process: unset {A}"]),
    ("vllm-engine-kernels", {"VLLM_BATCH_INVARIANT": "0"},
     ["VLLM_BATCH_INVARIANT=0 is exported, but --impl vllm-engine-kernels needs VLLM_BATCH_INVARIANT=1",
      "unset VLLM_BATCH_INVARIANT (the suite sets it itself)"]),
])
def test_a_contradicting_export_is_one_usage_error(inner, monkeypatch, impl, exported, needles, one_error_line):
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    res, seen = inner("--impl", impl)
    line = one_error_line(res)
    assert all(n in line for n in needles), line
    assert seen == {} and _left_over() == exported, "nothing is set when the export is refused"


def test_an_equal_export_is_kept_and_an_empty_one_is_unset(inner, monkeypatch):
    monkeypatch.setenv(A, "1")
    monkeypatch.setenv(B, "")
    res, seen = inner("--impl", FAKE)
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert seen["test-main"]["env"][B] == "off"
    assert _left_over() == {A: "1", B: ""}, "put back as the caller had them"


def test_put_back_after_a_later_usage_error(inner, one_error_line):
    """The variables are set before the rest of the command line is checked (a bad --model):
    unconfigure still puts them back."""
    res, _ = inner("--impl", FAKE, "--model", "no-such-recipe")
    assert "--model no-such-recipe" in one_error_line(res)
    assert _left_over() == {}


@pytest.mark.parametrize("declares, needle", [
    ({A: 1}, f"--impl {FAKE}: process_environment() must map variable names to strings, got '{A}': 1"),
    ("not a mapping", f"--impl {FAKE}: process_environment() raised ValueError"),
])
def test_a_bad_declaration_is_one_usage_error(inner, declares, needle, one_error_line):
    res, _ = inner("--impl", FAKE, declares=declares)
    assert needle in one_error_line(res)
    assert _left_over() == {}


# ---------------------------------------------------------------------------------------------
# the vLLM implementation's declaration
# ---------------------------------------------------------------------------------------------
def test_vllm_engine_kernel_trainer_declares_vllm_batch_invariant():
    from fixtures.vllm import implementation as vimpl
    ek = vimpl.VLLMImplementation(trainer="engine-kernels", fake="echo", max_idle=0)
    assert isinstance(ek, C.ConfiguresProcess) and ek.process_environment() == {"VLLM_BATCH_INVARIANT": "1"}
    assert not isinstance(vimpl.VLLMImplementation(fake="echo", max_idle=0), C.ConfiguresProcess)
    presets = {f.__name__: isinstance(f(), C.ConfiguresProcess)
               for f in (vimpl.engine_kernel_trainer, vimpl.module_trainer, vimpl.transformers_backend,
                         vimpl.tensor_parallel_2,
                         vimpl.tensor_parallel_2_engine_kernels, vimpl.flash_attn, vimpl.triton_attn,
                         vimpl.native_defaults)}
    assert presets == {"engine_kernel_trainer": True, "module_trainer": True, "transformers_backend": True,
                       "tensor_parallel_2": False,
                       "tensor_parallel_2_engine_kernels": True, "flash_attn": False, "triton_attn": False,
                       "native_defaults": False}


def test_the_declaration_is_read_before_vllm_is_imported(tmp_path):
    """Loading the preset and asking its environment imports no vLLM (a `vllm` that refuses to be
    imported stands first on the path, in front of any installed one)."""
    poisoned = tmp_path / "poisoned" / "vllm"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise ImportError('vllm imported before its environment was set')\n")
    code = ("from fixtures.core.loader import load_implementation\n"
            "impl = load_implementation('vllm-engine-kernels')\n"
            "print(dict(impl.process_environment()), impl.describe()['impl'])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(poisoned.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'VLLM_BATCH_INVARIANT': '1'} vllm"
