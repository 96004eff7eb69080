"""Self-test set-up: import, once and up front, the modules an in-process pytester run would
otherwise import first. pytester restores sys.modules after each in-process run, so a module
first imported inside one is imported again later - and a module that registers a TORCH_LIBRARY
namespace (torch._inductor.test_operators, reached by transformers' model classes) cannot
register twice: the later import fails with "Could not import module 'Qwen3ForCausalLM'"."""
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

for _name in ("torch._inductor.test_operators", "transformers.models.llama.modeling_llama",
              "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
              "transformers.models.mamba2.modeling_mamba2", "transformers.models.nemotron_h.modeling_nemotron_h"):
    try:
        importlib.import_module(_name)
    except ImportError:     # an older transformers without the model: its tests say so themselves
        pass


@pytest.fixture
def write_suite(pytester, monkeypatch):
    """A pytester run of this repo's plugin: the repo on PYTHONPATH, and `write_suite(files)`
    lays {relative path: text} into the pytester directory and returns the pytester."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def write(files: dict[str, str]):
        for path, text in files.items():
            p = pytester.path / path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return pytester
    return write


@pytest.fixture
def one_error_line():
    """`check(result, *needles)`: the pytester run ended as a usage error (exit status 4) with
    exactly one `ERROR:` line on stderr, no traceback and no INTERNALERROR, holding every needle;
    returns that line."""
    def check(res, *needles: str) -> str:
        out, err = res.stdout.str(), res.stderr.str()
        assert res.ret == pytest.ExitCode.USAGE_ERROR, f"exit {res.ret}\n{out}\n{err}"
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("ERROR: "), err
        assert "Traceback" not in out + err and "INTERNALERROR" not in out + err
        for needle in needles:
            assert needle in lines[0], lines[0]
        return lines[0]
    return check


@pytest.fixture
def fake_model_dir(tmp_path):
    """A model directory the fake vLLM worker accepts (fixtures.vllm.fake_backend): config.json only."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000}))
    return tmp_path


@pytest.fixture
def fake_vllm_impl(tmp_path, monkeypatch):
    """The vLLM adapter on the fake worker backend (no GPU, no vLLM), its engines closed afterwards."""
    from fixtures.vllm import implementation as vimpl
    monkeypatch.setenv("CONFORMANCE_VLLM_LOG_DIR", str(tmp_path / "logs"))
    impl = vimpl.VLLMImplementation(fake="echo", max_idle=2)
    yield impl
    impl.pool.close_all()
