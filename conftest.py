"""The suite's fixtures: the documented contract between the gates and the system under test.

The plugin machinery (options, gate markers, verdicts, report) lives in fixtures/plugin/. This
file holds the fixtures tests use; their docstrings say exactly what an implementation must
provide. A third party implements `fixtures.core.contract.Implementation` and passes
`--impl package.module:factory`; nothing here needs to change.
"""
from __future__ import annotations

from pathlib import Path

import pytest

# The plugin's hook modules (fixtures/plugin/session.py says what each does); --plant-fault and
# --stock-gemm come from fixtures.plugin.faults.
pytest_plugins = ["fixtures.plugin.session", "fixtures.plugin.options", "fixtures.plugin.collection",
                  "fixtures.plugin.results", "fixtures.plugin.faults", "fixtures.runtime.scheduling",
                  "fixtures.runtime.exclusive", "fixtures.runtime.activity", "fixtures.plugin.records"]


@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The Implementation under test (from --impl): makes engines and trainers for a model dir.

    Must provide describe() -> dict, device() -> str, dtype() -> torch.dtype,
    make_trainer(model_dir) -> Trainer, make_engine(model_dir, EngineSettings) -> Engine
    (NotImplementedError where it has no engine: engine checks then skip with that reason).
    Optional capabilities (fixtures.core.contract): HasKernelMode, ProvidesKernels,
    ChecksEngineKernels; a check that needs one the implementation lacks is n/a, naming it.
    ConfiguresProcess: the plugin set its variables in this process before this fixture ran.
    """
    from fixtures.runtime.run_state import STATE
    return pytestconfig.stash[STATE].impl


@pytest.fixture(scope="session")
def model_name(request):
    """The model under test: a built-in recipe name or a local dir with config.json (--model).

    Parametrised over every --model given; a test that uses it runs once per model and its
    result counts toward that model's gate verdicts.
    """
    return request.param


@pytest.fixture(scope="session")
def proxy(model_name, pytestconfig, tmp_path_factory, impl):
    """The proxy model of `model_name` at --proxy size: a ProxySpec whose `path` is a directory
    with config.json + model.safetensors (seeded random weights, token ids only), built once per
    session; with --proxy checkpoint the --model directory itself. Engines and trainers load it
    from `path`."""
    from fixtures.models.checkpoint import checkpoint_spec
    from fixtures.models.proxies import build_engine_dummy, build_proxy
    from fixtures.plugin.collection import model_id
    from fixtures.runtime.run_state import STATE
    if pytestconfig.getoption("--proxy") == "checkpoint":     # the user's own weights, as they are
        return checkpoint_spec(model_name)
    dummy = pytestconfig.getoption("--proxy-weights") == "engine-dummy"
    experts = pytestconfig.stash[STATE].proxy_experts.get(model_name)     # --proxy-experts, as the controller chose
    _check_proxy_fits(model_name, pytestconfig.getoption("--proxy"), impl, copies=1 if dummy else 2, experts=experts)
    out = tmp_path_factory.mktemp(f"proxy-{model_id(model_name)}")
    if dummy:
        return build_engine_dummy(model_name, pytestconfig.getoption("--proxy"), out, dtype=impl.dtype(),
                                  experts=experts)
    return build_proxy(model_name, pytestconfig.getoption("--proxy"), out,
                       seed=pytestconfig.getoption("--proxy-seed"), dtype=impl.dtype(), experts=experts)


def _check_proxy_fits(model_name, size, impl, copies: int = 2, experts: int | None = None) -> None:
    """A proxy the machine cannot hold is "not run" with the numbers, not an out-of-memory kill."""
    import os
    import torch
    from fixtures.models.proxies import proxy_config, source_config, tensor_specs
    if size == "tiny":
        return
    _, params = tensor_specs(proxy_config(source_config(model_name), size, experts))
    need = params * torch.finfo(impl.dtype()).bits // 8
    if str(impl.device()).startswith("cuda") and torch.cuda.is_available():
        have, where = torch.cuda.mem_get_info()[0], "free GPU memory"
    else:
        from fixtures.core.environment import host_available_bytes
        # MemAvailable, not free pages: the proxy files just written sit in the page cache it can drop
        have = host_available_bytes() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "available memory"
    if copies * need > have:   # the engine and the trainer each hold a copy (engine-dummy: the engine only)
        pytest.skip(f"the {size} proxy of {model_name} has {params / 1e9:.2f}B parameters: "
                    f"{copies * need / 2**30:.1f} GiB for {'engine + trainer' if copies == 2 else 'the engine'} "
                    f"in {impl.dtype()}, "
                    f"{have / 2**30:.1f} GiB {where} (use --proxy tiny on the CPU lane)")


def skip_not_available(exc: NotImplementedError, what: str):
    """An implementation's NotImplementedError is a declared "n/a" skip, with its own reason."""
    from fixtures.core.outcomes import not_available
    not_available(exc, what)


@pytest.fixture(scope="session")
def trainer(impl, proxy):
    """A Trainer holding the proxy (fixtures.core.contract.Trainer): logprobs(sequences, layout=,
    micro_batch_size=) -> list of float32 [len-1] tensors; module() -> the torch module it runs;
    export_weights() -> {canonical name: tensor}. One per model per session."""
    try:
        t = impl.make_trainer(proxy.path)
    except NotImplementedError as exc:
        skip_not_available(exc, "no trainer")
    yield t
    t.close()


@pytest.fixture(scope="session")
def engine_factory(impl, proxy):
    """Callable (EngineSettings) -> Engine for the proxy; skips the test with the implementation's
    reason where it provides no engine. Engines are context managers: use `with`. Every
    generate() / prompt_logprobs() result is shape-checked before any value is compared
    (fixtures.checks.completion_shapes)."""
    from fixtures.core.contract import EngineSettings

    from fixtures.checks.completion_shapes import shape_checked

    def make(settings: EngineSettings = EngineSettings()):
        try:
            return shape_checked(impl.make_engine(proxy.path, settings))
        except NotImplementedError as exc:
            skip_not_available(exc, "no engine")
    return make


@pytest.fixture(scope="session")
def engine(engine_factory):
    """The engine under test with default EngineSettings (invariance on), shared per model.

    generate(requests) -> [Completion] in request order; prompt_logprobs(seqs) -> [float32 len-1];
    capabilities() -> Capabilities; last_stats() -> EngineStats of the last generate() call,
    the evidence that a declared mechanism (prefix cache, chunking, preemption) engaged."""
    with engine_factory() as e:
        yield e


@pytest.fixture(scope="session")
def inventory(trainer, proxy, model_name, impl, artifact_dir):
    """The C0 inventory of the trainer's module (prefill, decode, padded training forward,
    backward), traced once per model inside the implementation's kernel mode so it also records
    which kernel served each op; written into the report. Gates C0 and C8 read it."""
    from fixtures.checks.inventory import take_inventory
    from fixtures.core.contract import HasKernelMode, RunsEngineKernels
    from fixtures.plugin.collection import model_id
    if isinstance(trainer, RunsEngineKernels):
        from fixtures.core.outcomes import not_applicable
        not_applicable("the trainer is RunsEngineKernels: it runs the engine's kernels outside torch dispatch, so "
                       "its aten trace is not what it runs; C0 checks its forward kernels against the engine's "
                       "instead (test_c0_engine_kernels.py::test_trainer_forward_runs_the_engine_kernels)",
                       capability=RunsEngineKernels)
    inv = take_inventory(trainer.module(), model_id(model_name), vocab_size=proxy.config.vocab_size,
                         table=impl.kernel_table(),
                         kernel_mode=impl.kernel_mode if isinstance(impl, HasKernelMode) else None)
    inv.write(artifact_dir, f"inventory-{model_id(model_name)}")
    return inv


@pytest.fixture(scope="session")
def engine_kernel_inventory(engine_factory, proxy, model_name, artifact_dir, pytestconfig):
    """The engine's own kernels (an engine that is InventoriesKernels, i.e. vLLM): every CUDA
    kernel launched for a prefill + decode + sampling workload
    (fixtures.models.seeded_inputs.kernel_inventory_workload), with the op, module class and phase that
    launched it; written into the report. C0 maps each kernel; C2 checks the cases the kernels map
    to. Skips "n/a" for other engines (the reference engine runs the trainer's kernels)."""
    import json
    from fixtures.models.seeded_inputs import kernel_inventory_workload
    from fixtures.core.contract import EngineSettings, InventoriesKernels
    from fixtures.plugin.collection import model_id
    from fixtures.runtime.worker_files import once_per_run
    name = f"engine-kernels-{model_id(model_name)}"

    def inventory():
        with engine_factory(EngineSettings(cuda_graphs=False, compilation=False)) as engine:
            if not isinstance(engine, InventoriesKernels):
                from fixtures.core.outcomes import not_applicable
                not_applicable("the engine is not InventoriesKernels (its kernels are the trainer's, "
                               "inventoried by test_c0_inventory.py)", capability=InventoriesKernels)
            try:
                inv = engine.kernel_inventory(kernel_inventory_workload(proxy.config.vocab_size),
                                              model=model_id(model_name))
            except NotImplementedError as exc:
                skip_not_available(exc, "no kernel inventory")
        (artifact_dir / f"{name}.json").write_text(json.dumps(inv.as_dict(), indent=1, sort_keys=True))
        (artifact_dir / f"{name}.md").write_text(inv.markdown())
        return inv
    from fixtures.runtime.exclusive import answer_room_requests
    # one engine and profile for all xdist workers; a waiting one answers the computing one's room request
    return once_per_run(pytestconfig, name, inventory, while_waiting=lambda: answer_room_requests(pytestconfig))
