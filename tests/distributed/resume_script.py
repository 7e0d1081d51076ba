"""A tiny training run that checkpoints every step; used by test_resume.py as a subprocess.

    python resume_script.py ROOT STEPS [--resume] [--kill-in-save N]

Prints one JSON line with the losses it computed. --kill-in-save N SIGKILLs this process in
the middle of the N-th save: after the dist checkpoint files are written, before the rename.
"""

import json
import os
import signal
import sys


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    resume = "--resume" in sys.argv
    kill_at = (
        int(sys.argv[sys.argv.index("--kill-in-save") + 1]) if "--kill-in-save" in sys.argv else 0
    )

    import torch

    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import checkpoint, parallel, train_checkpoint
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown
    from cwgrpo_megatron.megatron.train_step import train_step

    torch.set_num_threads(1)
    init_distributed()
    cfg = layout_check.layout_config(
        tp=1,
        pp=1,
        micro_batches=2,
        global_batch=8,
        group_size=4,
        steps=steps,
        world_size=1,
        overrides=["optim.optimizer=adam", "optim.lr=1e-3"],
    )
    actor, _ = layout_check.tiny_actor(cfg)
    start = 0
    if resume:
        start = train_checkpoint.load(actor, train_checkpoint.latest(root))["next_batch"]
    saves = 0
    real_save = checkpoint.dist_checkpointing.save

    def save_then_maybe_die(*args, **kwargs):
        real_save(*args, **kwargs)
        if saves == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.dist_checkpointing.save = save_then_maybe_die
    losses = []
    for step in range(start, steps):
        batch = synthetic_batch(prompts=2, group_size=4, seq_len=16, vocab_size=1000, seed=step)
        losses += [r.loss for r in train_step(actor, batch)]
        saves += 1
        train_checkpoint.save(actor, root, data_state={"next_batch": step + 1}, keep_last=2)
    print(json.dumps({"losses": losses, "start": start}))
    parallel.destroy()
    shutdown()


if __name__ == "__main__":
    main()
