"""An adapter for `--impl examples.my_rl_adapter:make`: a minimal RL trainer over transformers'
AutoModelForCausalLM with stock torch on the CPU - the template for wiring in your own system
(README, "Plugging in your own system"; the contract is fixtures/core/contract.py).

What it provides:
- the Trainer contract: `logprobs`, `module`, `export_weights`, `close`, `layouts`;
- the optional capabilities C8 and C9 ask for: TrainsRL (`train_step`, `weight_hashes`,
  `export_weights`), LogprobsWithGrad (`logprobs_with_grad`) and DeclaresOptimizer
  (`optimizer_spec`: the optimizer train_step applies, which C8 replays in float64);
- no engine (make_engine raises NotImplementedError: the engine gates C3-C5, C7 and C9 are n/a),
  no kernel mode (not HasKernelMode: C0's kernel-table check is n/a) and no kernel library (not
  ProvidesKernels: C2 is n/a). Add them as your system has them; every gate that needs one says
  which, by the capability's name.

It is batch-invariant by construction, not by its kernels: every sequence is its own micro-batch
of one (no padding, no companions), so a sequence's bits never depend on the others - correct and
slow. Your trainer will batch; then its kernels must be batch-invariant (C2, C6 say where not).

Try it:
    python -m fixtures.checks.selftest --impl examples.my_rl_adapter:make --model llama
    pytest -n 2 --impl examples.my_rl_adapter:make --model=llama --upto C9
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fixtures.core.contract import Implementation, Layout, OptimizerSpec


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes - the same recipe as the built-in engine's
    weight_hashes() (C9 compares the two after a weight push)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class MyTrainer:
    """The training side. Replace the body of each method with your own code."""

    name = "my-trainer (transformers, stock torch, one sequence per micro-batch)"
    layouts = (Layout.PADDED,)     # one sequence per micro-batch: nothing is padded; no packed layout

    def __init__(self, model_dir: Path, lr: float = 1e-2):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="eager")
        self.model.train()
        # DeclaresOptimizer: what train_step's update is (C8 holds it to a float64 step); built from the declaration
        self.optimizer_spec = OptimizerSpec("sgd", lr=lr)
        self.optimizer = self.optimizer_spec.make(self.model.parameters())
        self.checkpoint_names = set()
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                self.checkpoint_names.update(fh.keys())

    # -- the Trainer contract -------------------------------------------------------------------
    def logprobs_with_grad(self, sequences: Sequence[Sequence[int]], *, layout: Layout | None = None,
                           micro_batch_size: int | None = None) -> list[torch.Tensor]:
        """LogprobsWithGrad: log p(seq[t] | seq[:t]) for t = 1..n-1, full vocabulary, float32, with
        the autograd graph (C8 differentiates it). Each sequence alone: a micro-batch of one."""
        if layout is not None and Layout(layout) not in self.layouts:
            raise NotImplementedError(f"n/a: {self.name} has no {Layout(layout).value} layout")
        out = []
        for seq in sequences:
            ids = torch.tensor([list(map(int, seq))], dtype=torch.long)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1]
            lp = torch.log_softmax(logits.float(), dim=-1)
            out.append(lp.gather(-1, ids[0, 1:, None]).squeeze(-1))
        return out

    def logprobs(self, sequences, *, layout=None, micro_batch_size=None) -> list[torch.Tensor]:
        """float32 CPU tensor of the len(seq)-1 raw logprobs of seq[1:] per sequence."""
        with torch.no_grad():
            return [lp.detach().float().cpu().contiguous()
                    for lp in self.logprobs_with_grad(sequences, layout=layout, micro_batch_size=micro_batch_size)]

    def module(self) -> torch.nn.Module:
        return self.model                  # traced by C0 (the op inventory) and by the localisation

    # -- TrainsRL (C9) --------------------------------------------------------------------------
    def train_step(self, sequences, *, prompt_lens, advantages, layout=None, micro_batch_size=None) -> dict:
        """One policy-gradient step: loss = -mean over sequences of advantage * sum of the logprobs
        of the generated tokens (positions >= prompt_len); backward; one optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        lps = self.logprobs_with_grad(sequences, layout=layout)
        loss = torch.stack([-(adv * lp[pl - 1:].sum()) for lp, pl, adv in zip(lps, prompt_lens, advantages)]).mean()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its checkpoint name (as in model.safetensors: a tied LM head once).
        For dense transformers models these are the state_dict's own keys."""
        state = self.model.state_dict()
        return {k: state[k].detach() for k in sorted(self.checkpoint_names) if k in state}

    def weight_hashes(self) -> dict[str, str]:
        return {k: tensor_sha256(v) for k, v in self.export_weights().items()}

    def close(self) -> None:
        self.model = None


class MyImplementation(Implementation):
    """What `--impl examples.my_rl_adapter:make` returns: makes the trainers (and, in your system,
    the engines: override make_engine) for a model directory."""

    name = "my-rl"

    def describe(self) -> dict[str, str]:
        return {"impl": self.name, "trainer": MyTrainer.name, "engine": "none", "dtype": "float32", "device": "cpu"}

    def make_trainer(self, model_dir: Path) -> MyTrainer:
        return MyTrainer(model_dir)


def make() -> MyImplementation:
    return MyImplementation()
