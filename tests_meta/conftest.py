"""Self-test set-up: import, once and up front, the modules an in-process pytester run would
otherwise import first. pytester restores sys.modules after each in-process run, so a module
first imported inside one is imported again later - and a module that registers a TORCH_LIBRARY
namespace (torch._inductor.test_operators, reached by transformers' model classes) cannot
register twice: the later import fails with "Could not import module 'Qwen3ForCausalLM'"."""
import importlib

for _name in ("torch._inductor.test_operators", "transformers.models.llama.modeling_llama",
              "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
              "transformers.models.mamba2.modeling_mamba2", "transformers.models.nemotron_h.modeling_nemotron_h"):
    try:
        importlib.import_module(_name)
    except ImportError:     # an older transformers without the model: its tests say so themselves
        pass
