"""A two-rank data-parallel RL loop that cannot be imported into pytest, judged through records
(docs/records.md). Run it, then judge it:

    python -m torch.distributed.run --nproc_per_node 2 examples/records_torchrun.py OUT
    pytest --records=OUT/records

CPU and gloo. Rank 0 holds the rollout engine (the suite's reference engine) and broadcasts each
step's rollout; every rank holds a trainer (the reference proxy), reads its share of every planned
micro-batch, and trains with its own loop: policy-gradient loss on its share, gradients summed
across ranks (all-reduce), a plain SGD step. Rank 0 pushes the weights to the engine. Each rank
writes its own records shard with fixtures.records.RecordWriter; the plan comes from
fixtures.records.plan (what `pytest --write-plan` writes)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fixtures.records.drive import reward, sample
from fixtures.records.plan import make_plan, write_plan
from fixtures.records.writer import RecordWriter

LR = 1e-2


def train_share(trainer, rollout: dict, ids: list[str], rank: int, world: int) -> None:
    """This rank's sequences (every world-th), loss summed over them and divided by the global
    count; gradients all-reduced (sum), then SGD: every rank takes the same step."""
    rewards = torch.tensor([reward(rollout[s]["token_ids"]) for s in ids], dtype=torch.float64)
    adv = (rewards - rewards.mean()).tolist()
    mine = list(range(rank, len(ids), world))
    model = trainer.model
    model.zero_grad(set_to_none=True)
    seqs = [rollout[ids[k]]["prompt_ids"] + rollout[ids[k]]["token_ids"] for k in mine]
    lps = trainer.logprobs_with_grad(seqs)
    loss = sum(-(adv[k] * lp[len(rollout[ids[k]]["prompt_ids"]) - 1:].sum()) for k, lp in zip(mine, lps)) / len(ids)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.add_(p.grad, alpha=-LR)


def main(out: Path) -> None:
    from fixtures.models.proxies import build_proxy
    from fixtures.reference.implementation import ReferenceImplementation
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if rank == 0:
        build_proxy("llama", "tiny", out / "proxy", seed=0)
    dist.barrier()
    proxy = out / "proxy"
    from transformers import AutoConfig
    plan = make_plan("llama", AutoConfig.from_pretrained(proxy).vocab_size)
    records = out / "records"
    if rank == 0:
        write_plan(plan, records)
    impl = ReferenceImplementation()
    trainer = impl.make_trainer(proxy)
    engine = impl.make_engine(proxy) if rank == 0 else None
    with RecordWriter(records, rank=rank, world_size=world, writer="examples/records_torchrun.py") as w:
        w.weights(0, trainer.weight_hashes(), side="trainer")
        if engine is not None:
            w.weights(0, engine.weight_hashes(), side="engine")
        for step in plan["steps"]:
            version = step["weight_version"]
            box = [sample(engine, step) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            rollout = box[0]
            if rank == 0:
                for sid, r in rollout.items():
                    w.rollout(step=step["step"], id=sid, weight_version=version, **r)
            for comp in step["compositions"]:
                share = comp["micro_batches"][rank::world]       # data parallel: every world-th micro-batch
                logprobs = {}
                for mb in share:
                    seqs = [rollout[s]["prompt_ids"] + rollout[s]["token_ids"] for s in mb]
                    for s, lp in zip(mb, trainer.logprobs(seqs, layout=comp["layout"])):
                        logprobs[s] = lp[-len(rollout[s]["token_ids"]):]
                if share:
                    w.trainer_pass(step=step["step"], composition=comp["name"], weight_version=version,
                                   layout=comp["layout"], micro_batches=share, logprobs=logprobs)
            if not step["push_after"]:
                continue
            train_share(trainer, rollout, list(rollout), rank, world)
            w.weights(version + 1, trainer.weight_hashes(), side="trainer")
            if engine is not None:
                engine.load_weights(trainer.export_weights())
                w.weights(version + 1, engine.weight_hashes(), side="engine")
            dist.barrier()
    if engine is not None:
        engine.close()
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
