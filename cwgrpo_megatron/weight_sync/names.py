"""The weight paths by name: one word for each in the config (rollout.weight_sync), the engines'
side (`receiver.WeightReceiver.sync_path`), the trainer's side (`senders`), the sync's result
and the log line (`weight sync path: shm`).

    shm     the trainer's ranks write their shards into a shared-memory buffer laid out as
            the HF model (`shm`, in rollout.shm_dir), sending a shard a node lacks across the
            network once for the node; the engine loads the buffer. Any number of engines.
    ipc     every rank exports the whole model on its GPU and vLLM's weight transfer hands it
            over CUDA IPC to the engine on the same GPU (`ipc`; engines colocated on GPUs).
    nccl    each engine's owner exports the whole model and broadcasts it over NCCL to its
            engine's GPUs (`nccl`; engines on GPUs of their own).
    stream  the whole model as HF-named full tensors, gathered to rank 0 and handed to the one
            engine there (`export`): the torch backend, and vLLM in-process on a GPU, which
            reads the trainer's tensors themselves. One engine.
"""

SYNC_PATHS = ("shm", "ipc", "nccl", "stream")
CHOSEN_PATHS = ("shm", "ipc", "nccl")
"""The paths rollout.weight_sync may name; stream is the path of an engine without a buffer."""
TRANSFER_PATHS = ("ipc", "nccl")
"""The paths through vLLM's own weight transfer (`receiver.WeightReceiver.load_transfer`)."""
