"""Step 10 of a training step: the trainer's weights into every replica's engine, and, every
run.verify_sync steps, the check that each engine now scores like the trainer.

    WeightSync = the sync plan (who writes which shard into which node's buffers; fixed for the
                 run) + the sender of the run's weight path (`weight_sync.senders`, resolved
                 once) + the verifier (its tolerance calibrated on the start checkpoint)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cwgrpo_megatron.checks.sync_check import SyncVerifier
from cwgrpo_megatron.comm import job_rank
from cwgrpo_megatron.comm.collectives import Group
from cwgrpo_megatron.config import Config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.megatron.model import DTYPES, use_transformer_engine
from cwgrpo_megatron.megatron.publish import sync_plan, weight_sender
from cwgrpo_megatron.rollout.base import RolloutEngine
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync.plan import SyncPlan
from cwgrpo_megatron.weight_sync.senders import Sender

log = logging.getLogger("cwgrpo_megatron.train")


@dataclass(kw_only=True)
class WeightSync:
    arch: ModelArch
    dtype: str
    """The engines' dtype (`Config.engine_dtype`), which the shards are cast to."""
    plan: SyncPlan
    sender: Sender
    verifier: SyncVerifier | None
    """None when run.verify_sync is 0."""
    verify_every: int

    @classmethod
    def build(
        cls,
        cfg: Config,
        replicas: Replicas,
        model,
        arch: ModelArch,
        engine: RolloutEngine | None,
        *,
        control: Group,
    ) -> WeightSync:
        """The plan (one all_gather_object of every rank's shard), the sender of the engines'
        weight path (one more, of the owners' offers), both over the job's control group
        `control`, and, when run.verify_sync asks for one, the verifier, calibrated now:
        trainer and engines both hold the start checkpoint."""
        plan = sync_plan(replicas, arch, control=control)
        sender = weight_sender(plan, engine, arch, dtype=cfg.engine_dtype, control=control)
        rank = job_rank()
        if rank == 0:
            spec = use_transformer_engine()
            received = plan.received_bytes(arch, DTYPES[cfg.engine_dtype], te_spec=spec)
            log.info("weight sync path: %s", sender.path)
            log.info(
                "weight sync: per sync each node receives from the others %s",
                ", ".join(f"node {n}: {b / 2**20:.1f} MiB" for n, b in received.items()),
            )
        verifier = None
        if cfg.run.verify_sync:
            verifier = SyncVerifier(min_tol=cfg.run.verify_sync_tol)
            gap = verifier.calibrate(model, arch, engine)
            if rank == 0:
                tol = verifier.tol
                log.info(
                    "sync check: start gap %.2e (mean %.2e), tolerance %.2e (mean %.2e)",
                    *(gap.max, gap.mean, tol.max, tol.mean),
                )
        return cls(
            arch=arch,
            dtype=cfg.engine_dtype,
            plan=plan,
            sender=sender,
            verifier=verifier,
            verify_every=cfg.run.verify_sync,
        )

    def push(self, model, engine: RolloutEngine | None) -> dict[str, float]:
        """Weights into every engine (every rank calls this; `engine` on the owners): the most
        MiB a node received from the others."""
        done = self.sender.send(model, engine)
        return {"sync/received_mb": max(done.received.values()) / 2**20}

    def check(self, model, engine: RolloutEngine | None, *, step: int | None) -> dict[str, float]:
        """After step `step`'s push, when a check is due (every run.verify_sync steps; always
        for `step` None): the worst engine's gap to the trainer and the tolerance
        (SyncMismatchError on every rank above it); {} otherwise. The engines must be awake."""
        due = step is None or (self.verify_every and step % self.verify_every == 0)
        if not due or self.verifier is None:
            return {}
        gap, tol = self.verifier.check(model, self.arch, engine), self.verifier.tol
        return {"sync/gap": gap.max, "sync/tol": tol.max, "sync/gap_mean": gap.mean,
                "sync/tol_mean": tol.mean}  # fmt: skip
