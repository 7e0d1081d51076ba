"""The rollout engines' settings: backend, sampling limits, memory, placement."""

from dataclasses import dataclass

from cwgrpo_megatron.common.settings import check_choice, check_range
from cwgrpo_megatron.rollout.names import LONG_PROMPT_POLICIES, ROLLOUT_BACKENDS
from cwgrpo_megatron.weight_sync.names import CHOSEN_PATHS

DTYPE_NAMES = ("float32", "bfloat16")
SLEEP_LEVELS = (0, 1, 2)
PLACEMENTS = ("colocated", "separate")
ASYNC_STEPS = (0, 1)


@dataclass(kw_only=True, frozen=True)
class RolloutConfig:
    """The rollout engine. Its temperature is train.temperature: one value for both sides."""

    backend: str = "vllm"
    """Rollout backend: vllm, or torch (plain-torch sampling, for machines without vLLM)."""
    top_p: float = 1.0
    """Nucleus sampling; < 1 makes rollout log-probs differ from the trainer's (see tis_cap)."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    max_tokens: int = 3584
    """Max completion tokens (Open-RS: 3584)."""
    max_model_len: int = 4096
    """Max prompt + completion tokens the engine holds."""
    long_prompt: str = "error"
    """A prompt that leaves no room for max_tokens: error, or truncate (keep its last tokens)."""
    dtype: str | None = None
    """Engine dtype: float32 or bfloat16; None means train.params_dtype."""
    in_process: bool | None = None
    """vLLM in this process (one-process runs only) or in engine processes; None: automatic."""
    kv_cache_mb: int = 1024
    """vLLM KV cache on CPU, MiB (on GPU gpu_memory_utilization applies)."""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory when colocated with training."""
    sleep_level: int | None = None
    """What each engine frees on its GPUs while the trainer works (docs/design.md, section
    4): 2 its weights and KV cache (the weights are synced again before the next rollouts),
    1 its KV cache, its weights kept in host memory, 0 nothing (it never sleeps). None: 2 on
    GPUs, 0 on CPU, where vLLM has no sleep mode (a level above 0 is then traced by
    run.trace_engine but frees nothing)."""
    enforce_eager: bool | None = None
    """Run vLLM eagerly (true), or compile the model (false: torch.compile, and CUDA graphs on
    a GPU). None: compiled on a GPU, where CUDA graphs are vLLM's default and decoding is
    launch-bound without them; eager on CPU. On 2 CPU cores with SmolLM2-135M (the demo's
    rollouts, benchmarks/bench_vllm_compile.py), compiling adds 131 s to the engine's start
    with an empty compile cache (81 s with a warm one) and saves 0.28 s (0.96 s) of an 8.5 s
    rollout: it pays after some 470 (84) steps, not within the demo's 8."""
    shm_dir: str = "/dev/shm"
    """Where the vLLM engine's weight-sync buffer lives: a tmpfs with room for one copy of the
    model in the engine dtype, kept while the engine runs."""
    weight_sync: str | None = None
    """The weight path to a vLLM engine (`weight_sync.names`; the log says which one a run
    takes: `weight sync path: shm`): ipc (CUDA IPC from every rank on the engine's GPUs,
    through vLLM's weight transfer), nccl (a broadcast from the engine's owner to an engine
    on GPUs of its own, through vLLM's weight transfer) or shm (a buffer in shm_dir, through
    host memory). None: on GPUs ipc, or nccl with placement=separate; shm on CPU. An
    in-process engine on a GPU, and the torch backend, take stream (the whole model as full
    tensors) either way. ipc and nccl fall back to shm for a sync whose shards cross nodes
    (a pipeline stage on another node)."""
    replicas: int | str = "auto"
    """Engine replicas: auto (on GPUs one engine per `tp` consecutive GPUs of every node, so
    that every GPU generates; on CPU one per node), per_node (one engine on each node, as
    torchrun counts nodes), or how many in the whole job: a multiple of the node count (each
    node's ranks are split evenly into groups of consecutive ranks; a group's first rank owns
    its engine), or fewer than the nodes (one on each of the first ones; 1: one engine, on
    rank 0). Each replica generates
    its share of a step's prompts and scores it (`rollout.replicas`)."""
    tp: int = 1
    """The engine's tensor-parallel size: on GPU it runs on the first `tp` devices of its
    replica's ranks, so a replica must span at least `tp` ranks."""
    placement: str = "colocated"
    """Where the engines run (docs/training.md#one-step-off-rollouts). colocated: on the
    trainer's devices, taking turns with it. separate: on devices of their own, so that
    generation can overlap training (`async_steps`): on GPUs the `gpus_per_node` GPUs of each
    node after the trainer's (torchrun starts one rank per other GPU), on CPU `cpu_cores` cores
    of each node (the engines' processes are bound to them, the trainer's to the rest). Needs
    engine processes (the vllm backend, in_process false or unset); the engines never sleep."""
    gpus_per_node: int = 0
    """With placement=separate on GPUs: each node's GPUs that hold engines (a multiple of
    `tp`; one engine per `tp` of them)."""
    cpu_cores: int = 1
    """With placement=separate on CPU: each node's cores bound to its engines (the last ones the
    process may use); the trainer's ranks keep the rest."""
    async_steps: int = 0
    """0: each step's rollouts are generated, then trained on. 1 (placement=separate): step
    k+1's rollouts are generated, with the weights after step k-1, while step k trains; the
    policy lag is 1 (`rollout/policy_lag`) and the truncated importance weight (algo.tis_cap)
    corrects it. More steps off the policy are not built."""

    def __post_init__(self) -> None:
        check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS.names())
        check_choice("rollout.long_prompt", self.long_prompt, LONG_PROMPT_POLICIES)
        if self.weight_sync is not None:
            check_choice("rollout.weight_sync", self.weight_sync, CHOSEN_PATHS)
        if self.sleep_level is not None:
            check_choice("rollout.sleep_level", self.sleep_level, SLEEP_LEVELS)
        if self.dtype is not None:
            check_choice("rollout.dtype", self.dtype, DTYPE_NAMES)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        check_range("rollout.top_k", self.top_k, low=0)
        for key in ("max_tokens", "kv_cache_mb", "tp"):
            check_range(f"rollout.{key}", getattr(self, key), low=1)
        if self.replicas not in ("auto", "per_node") and not (
            isinstance(self.replicas, int) and self.replicas >= 1
        ):
            raise ValueError(
                f"rollout.replicas={self.replicas!r} must be auto, per_node or a positive integer"
            )
        check_range(
            "rollout.gpu_memory_utilization", self.gpu_memory_utilization, low=0.01, high=1.0
        )
        check_choice("rollout.placement", self.placement, PLACEMENTS)
        check_range("rollout.gpus_per_node", self.gpus_per_node, low=0)
        check_range("rollout.cpu_cores", self.cpu_cores, low=1)
        self._check_async()
        if self.max_tokens >= self.max_model_len:
            raise ValueError(
                f"rollout.max_tokens={self.max_tokens} leaves no room for a prompt in "
                f"rollout.max_model_len={self.max_model_len}"
            )

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    def _check_async(self) -> None:
        if self.async_steps not in ASYNC_STEPS:
            raise ValueError(
                f"rollout.async_steps={self.async_steps}: only 0 (synchronous) and 1 (one step "
                "off the policy) are built; a lag above 1 needs a staleness bound and a "
                "decoupled objective this trainer does not have yet"
            )
        if self.async_steps and not self.separate:
            raise ValueError(
                "rollout.async_steps=1 overlaps generation with training, which needs engines "
                "on devices of their own: set rollout.placement=separate"
            )
        if not self.separate:
            if self.weight_sync == "nccl":
                raise ValueError(
                    "rollout.weight_sync=nccl sends to engines on GPUs of their own (NCCL cannot "
                    "join two processes on one GPU): set rollout.placement=separate, or leave it "
                    "unset (ipc)"
                )
            return
        if self.backend != "vllm" or self.in_process:
            raise ValueError(
                "rollout.placement=separate runs the engines in processes of their own: use "
                "rollout.backend=vllm with rollout.in_process unset or false"
            )
        if self.sleep_level:
            raise ValueError(
                f"rollout.sleep_level={self.sleep_level} frees an engine's memory for the "
                "trainer, which rollout.placement=separate does not share: leave it unset"
            )
        if self.weight_sync == "ipc":
            raise ValueError(
                "rollout.weight_sync=ipc hands the engine tensors on the trainer's own GPUs; with "
                "rollout.placement=separate leave it unset (nccl on GPUs, shm on CPU)"
            )
        if self.gpus_per_node % self.tp:
            raise ValueError(
                f"rollout.gpus_per_node={self.gpus_per_node} does not split into engines of "
                f"rollout.tp={self.tp} GPUs: use a multiple of it"
            )
