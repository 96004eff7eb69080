"""Bad input gets one clear line and pytest's usage-error exit status (4): no traceback, no
INTERNALERROR, nothing half-written (no empty --report folder left behind). Path options written
with a space (`--report DIR`, `--model DIR`, `--xfails FILE`) work wherever pytest lets them, and
are refused in one line that shows the `=` spelling where pytest cannot (fixtures/plugin/path_options.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures.models import proxies as P
from fixtures.plugin.path_options import normalised

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
USAGE = pytest.ExitCode.USAGE_ERROR

# named as the gates' defining checks (fixtures.core.gates), so C0 and C1 can pass
CHECKS = """
import pytest
@pytest.mark.C0
def test_no_unmapped_op(): pass
@pytest.mark.C1
def test_same_architecture_class(): pass
@pytest.mark.C1
def test_every_layer_kind_kept(): pass
"""


@pytest.fixture
def project(pytester, monkeypatch):
    """A suite laid out as this repository is: a config file at its root (pytest finds the root
    from it) and a conftest.py that registers the plugin."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    pytester.makeconftest('pytest_plugins = ["fixtures.plugin.session"]\n')
    (pytester.path / "tests_c0_inventory").mkdir()
    (pytester.path / "tests_c0_inventory" / "test_a.py").write_text(CHECKS)
    return pytester


def model_dir(where: Path, config: dict | None = None, **files: bytes) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(P.RECIPES["qwen3"] if config is None else config))
    for name, data in files.items():
        (where / name.replace("__", ".")).write_bytes(data)
    return where


def _safetensors(tmp_path) -> bytes:
    save_file({"w": torch.zeros(64)}, str(tmp_path / "w.safetensors"))
    return (tmp_path / "w.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# 1. --hypothesis-profile / HYPOTHESIS_PROFILE: checked before anything is made
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["option", "environment"])
def test_unknown_hypothesis_profile(project, tmp_path, monkeypatch, how, one_error_line):
    rep = tmp_path / "rep"
    args = ["--hypothesis-profile", "nope"] if how == "option" else []
    if how == "environment":
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "nope")
    res = project.runpytest_inprocess(*args, f"--report={rep}")
    line = one_error_line(res, "nope", "no such hypothesis profile", "ci, default, dev", "nightly")
    assert ("HYPOTHESIS_PROFILE=nope" in line) == (how == "environment")
    assert not rep.exists(), "a refused run left its report folder behind"


@pytest.mark.parametrize("args, needle", [
    (["--xfails", "no_such_file.txt"], "--xfails no_such_file.txt: no such file"),
    (["--upto", "C99"], "unknown gate 'C99'"),
    (["--model=no_such_recipe"], "no such directory"),
    (["--proxy-experts", "4"], "--proxy-experts 4: cuts the experts of a shallow or full proxy; --proxy tiny"),
    (["--proxy-experts", "many"], "--proxy-experts many: expected auto or a whole number"),
])
def test_a_refused_run_leaves_no_report_folder(project, tmp_path, args, needle, one_error_line):
    rep = tmp_path / "rep"
    one_error_line(project.runpytest_inprocess(*args, f"--report={rep}"), needle)
    assert not rep.exists()


def test_report_path_that_is_a_file(project, tmp_path, one_error_line):
    (tmp_path / "afile").write_text("x")
    one_error_line(project.runpytest_inprocess(f"--report={tmp_path / 'afile'}"), "exists and is not a directory")


# ---------------------------------------------------------------------------------------------
# 2. path options written with a space
# ---------------------------------------------------------------------------------------------
def test_normalised_spelling():
    assert normalised(["--model", "/m", "-x", "--report", "r", "--xfails", "--model", "a", "--upto", "C1"]) == \
        ("--model=/m", "-x", "--report=r", "--xfails", "--model=a", "--upto", "C1")
    assert normalised(["--model=/m", "--report"]) == ("--model=/m", "--report")


@pytest.mark.parametrize("spelling, xdist", [("space", False), ("space", True), ("equals", False)],
                         ids=["space", "space-xdist", "equals"])    # '=' under xdist: test_plugin.py
def test_path_options_in_either_spelling(project, tmp_path, spelling, xdist):
    """--report DIR (a new directory outside the project), --model DIR (inside it) and
    --xfails FILE, or all with '=' (--model=DIR outside the project); under xdist the workers
    parse the command line again, after the controller made DIR (see the next test)."""
    if xdist:
        pytest.importorskip("xdist")
    rep = tmp_path / "rep"
    model = model_dir(project.path / "models" / "mine") if spelling == "space" else model_dir(tmp_path / "mine")
    (project.path / "known.txt").write_text("tests_c0_inventory/test_a.py::test_gone  # renamed\n")
    opts = {"--report": str(rep), "--model": str(model.relative_to(project.path) if spelling == "space" else model),
            "--xfails": "known.txt"}
    args = [a for k, v in opts.items() for a in ((k, v) if spelling == "space" else (f"{k}={v}",))]
    res = project.runpytest_inprocess(*args, *(["-n", "2"] if xdist else []))
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    res.assert_outcomes(passed=3)
    doc = json.loads((rep / "report.json").read_text())
    assert doc["gates"]["C1"]["overall"] == "pass"
    assert doc["run"]["known_failures"] == [{"pattern": "tests_c0_inventory/test_a.py::test_gone", "reason": "renamed"}]
    assert doc["run"]["models"] == [opts["--model"]]


def test_xdist_workers_get_the_equals_spelling(project, tmp_path):
    """Workers parse the controller's raw command line again: a separate --report DIR that exists
    by then (the controller made it) would root each worker in DIR, without this suite."""
    config = project.parseconfigure("--report", str(tmp_path / "rep"), "--model", "llama", "-k", "c1")
    assert config.invocation_params.args[:3] == (f"--report={tmp_path / 'rep'}", "--model=llama", "-k")


@pytest.mark.parametrize("option", ["--model", "--xfails", "--report"])
def test_a_separate_existing_path_outside_the_project_is_refused_with_the_equals_spelling(project, tmp_path, option, one_error_line):
    """pytest roots the run at the separate value before any plugin is loaded; the pytest11 entry
    point (here loaded with -p, as an entry point is) says how to write it."""
    value = {"--model": model_dir(tmp_path / "mine"), "--xfails": tmp_path / "known.txt", "--report": tmp_path}[option]
    if option == "--xfails":
        value.write_text("x  # reason\n")
    res = project.runpytest_subprocess("-p", "fixtures.plugin.path_options", option, str(value), "--co")
    one_error_line(res, f"{option} {value}: pytest read the separate value as a test path", f"write {option}={value}")


def test_the_real_command_line_with_separate_values(tmp_path):
    """From the repository root, as people type it: --report DIR works (a new DIR; under xdist:
    test_path_options_in_either_spelling, 15 s more here), an existing --model DIR outside the
    repository is refused in one line."""
    rep, model = tmp_path / "x", model_dir(tmp_path / "mine")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    base = [sys.executable, "-m", "pytest", "-p", "fixtures.plugin.path_options", "-m", "C1", "-q"]
    ok = subprocess.run(base + ["--model", "qwen3", "--report", str(rep), "-k", "reproducible"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "1 passed" in ok.stdout and (rep / "report.json").is_file()
    bad = subprocess.run(base + ["--model", str(model), "--co"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == USAGE, bad.stdout + bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"write --model={model}" in lines[0], bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_the_guard_is_a_pytest11_entry_point():
    import tomllib
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["entry-points"]["pytest11"] == {"fixtures.plugin.path_options": "fixtures.plugin.path_options"}


# ---------------------------------------------------------------------------------------------
# 3. a config.json without a field the proxy is built from
# ---------------------------------------------------------------------------------------------
def test_config_without_a_width_field(project, tmp_path, one_error_line):
    cfg = {k: v for k, v in P.RECIPES["qwen3"].items() if k != "hidden_size"}
    d = model_dir(tmp_path / "nohidden", cfg)
    rep = tmp_path / "rep"
    one_error_line(project.runpytest_inprocess(f"--model={d}", f"--report={rep}", "--co"),
             f"{d / 'config.json'} has no 'hidden_size'", "hidden_size=4096")
    assert not rep.exists()


@pytest.mark.parametrize("recipe, drop, named", [
    ("llama", ("vocab_size", "intermediate_size"), "'vocab_size', 'intermediate_size'"),
    ("qwen3_moe", ("num_experts",), "'num_experts' or 'num_local_experts'"),
    ("mamba2", ("state_size",), "'state_size'"),
    ("nemotron_h", ("hybrid_override_pattern",), "'hybrid_override_pattern' or 'layers_block_type'"),
    ("nemotron_h", ("moe_intermediate_size",), "'moe_intermediate_size'"),
])
def test_required_fields_per_family(tmp_path, recipe, drop, named):
    d = model_dir(tmp_path, {k: v for k, v in P.RECIPES[recipe].items() if k not in drop})
    with pytest.raises(P.ProxyError, match="has no ") as e:
        P.source_config(d)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_required_fields_only_where_the_family_uses_them(tmp_path):
    for name in P.RECIPES:
        P.source_config(name)                       # every recipe is complete
    moe = {k: v for k, v in P.RECIPES["qwen3_moe"].items() if k != "intermediate_size"}
    P.source_config(model_dir(tmp_path / "a", moe))   # no dense layer: intermediate_size unused
    with pytest.raises(P.ProxyError, match="'intermediate_size'"):
        P.source_config(model_dir(tmp_path / "b", {**moe, "mlp_only_layers": [0]}))
    nano = {k: v for k, v in P.RECIPES["nemotron_h"].items() if k != "intermediate_size"}
    nano["hybrid_override_pattern"] = nano["hybrid_override_pattern"].replace("-", "E")   # no dense MLP layer
    P.source_config(model_dir(tmp_path / "c", nano))


# ---------------------------------------------------------------------------------------------
# 4. a checkpoint in the model dir: tested as it is by default (--proxy checkpoint), unused with a
#    proxy size (the header says which), refused when corrupt
# ---------------------------------------------------------------------------------------------
def test_checkpoint_in_the_model_dir(project, tmp_path, one_error_line):
    blob = _safetensors(tmp_path)
    good = model_dir(tmp_path / "good", model__safetensors=blob)
    res = project.runpytest_inprocess(f"--model={good}", "--co")
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    assert (f"conformance model good: {good}: the checkpoint itself (1 safetensors file); no proxy built - "
            "engine and trainer load its weights") in res.stdout.str()
    res = project.runpytest_inprocess(f"--model={good}", "--proxy", "tiny", "--co")
    assert (f"conformance model good: {good / 'config.json'} only; its model.safetensors is not used; "
            "weights: seeded proxy (seed 0)") in res.stdout.str()
    one_error_line(project.runpytest_inprocess("--model=llama", "--proxy", "checkpoint", "--co"),
             "--proxy checkpoint loads each --model directory's own weights: llama is a built-in recipe")
    one_error_line(project.runpytest_inprocess(f"--model={good}", "--proxy", "checkpoint", "--proxy-weights",
                                         "engine-dummy", "--co"), "--proxy checkpoint and --proxy-weights engine-dummy")
    rep = tmp_path / "rep"
    for name, files, needle in (
            ("truncated", {"model__safetensors": blob[:-16]}, "model.safetensors is corrupt or truncated"),
            ("garbage", {"model__safetensors": b"not a checkpoint"}, "model.safetensors is corrupt or truncated"),
            ("sharded", {"model__safetensors__index__json": json.dumps(
                {"weight_map": {"w": "model-00001-of-00002.safetensors"}}).encode()},
             "lists model-00001-of-00002.safetensors")):
        d = model_dir(tmp_path / name, **files)
        one_error_line(project.runpytest_inprocess(f"--model={d}", f"--report={rep}", "--co"), f"--model {d}: ", needle)
        assert not rep.exists()


def test_engine_dummy_header(project, tmp_path):
    d = model_dir(tmp_path / "mine", model__safetensors=_safetensors(tmp_path))
    res = project.runpytest_inprocess(f"--model={d}", "--proxy-weights", "engine-dummy", "--co")
    assert res.ret == 0
    assert "conformance model mine: " in res.stdout.str() and "weights: drawn by the engine" in res.stdout.str()


# ---------------------------------------------------------------------------------------------
# 5. the contract self-test on a recipe name / a config-only directory
# ---------------------------------------------------------------------------------------------
def test_selftest_accepts_recipes_and_config_only_dirs(tmp_path):
    from fixtures.reference.implementation import ReferenceImplementation
    from fixtures.checks.selftest import check_implementation
    impl = ReferenceImplementation()
    assert "trainer" in check_implementation(impl, "llama")
    d = model_dir(tmp_path / "cfg", P.RECIPES["llama"])
    assert "trainer" in check_implementation(impl, d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json"], "the proxy is built elsewhere"
    corrupt = model_dir(tmp_path / "corrupt", P.RECIPES["llama"], model__safetensors=b"truncated")
    for bad, needle in (("no_such_recipe", "no such directory (built-in recipes: "), (tmp_path / "empty", "no such directory"),
                        (corrupt, "corrupt or truncated"),
                        (model_dir(tmp_path / "bert", {"model_type": "bert"}), "has no proxy recipe")):
        with pytest.raises(ValueError) as e:
            check_implementation(impl, bad)
        assert isinstance(e.value, P.ProxyError) and needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# 6. model_type unknown to transformers vs known without a recipe
# ---------------------------------------------------------------------------------------------
def test_unknown_model_type_vs_no_recipe(project, tmp_path, one_error_line):
    import transformers
    unknown = model_dir(tmp_path / "unknown", {"model_type": "not_a_real_arch"})
    one_error_line(project.runpytest_inprocess(f"--model={unknown}", "--co"),
             f"transformers {transformers.__version__} does not know model_type 'not_a_real_arch'",
             "upgrade transformers or fix config.json")
    bert = model_dir(tmp_path / "bert", {"model_type": "bert"})
    line = one_error_line(project.runpytest_inprocess(f"--model={bert}", "--co"), "model_type 'bert' has no proxy recipe",
                    "docs/porting-guide.md")
    assert all(name in line for name in P.RECIPES)


def test_configs_the_rules_cannot_reduce_are_one_line_before_any_check(project, tmp_path, one_error_line):
    """An attention-free config that is not Mamba (RWKV), and one whose layer layout the depth cut
    cannot express (a Jamba whose kept expert layers no period / offset marks), are refused at
    start in one line - not as an error in every check that builds the proxy."""
    from transformers import JambaConfig, RwkvConfig
    rwkv = tmp_path / "rwkv"
    RwkvConfig().save_pretrained(rwkv)
    one_error_line(project.runpytest_inprocess(f"--model={rwkv}", "--co"),
                   "model_type 'rwkv' has no attention heads (an attention-free architecture other than Mamba)",
                   "not supported yet")
    jamba = tmp_path / "jamba"
    JambaConfig(attn_layer_period=3, attn_layer_offset=1).save_pretrained(jamba)
    one_error_line(project.runpytest_inprocess(f"--model={jamba}", "--co"),
                   "could not reduce jamba: the kept layers [0, 1, 3, 4]", "fixtures/models/reduce.py cut_depth")


def test_a_config_transformers_cannot_build_is_one_line(project, tmp_path, one_error_line):
    """transformers' own model code refusing a config (HunYuan-MoE's default config has no
    head_dim, and its attention computes head_dim ** -0.5) is one line naming the error - it was an
    INTERNALERROR traceback from deep inside transformers (measured)."""
    import json
    from transformers import CONFIG_MAPPING
    src = tmp_path / "hunyuan"
    CONFIG_MAPPING["hunyuan_v1_moe"]().save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (src / "config.json").write_text(json.dumps(config))
    one_error_line(project.runpytest_inprocess(f"--model={src}", "--co"),
                   "transformers cannot build a hunyuan_v1_moe model from this config (TypeError: ",
                   "check config.json against the model's own")
