"""The `vllm` rollout backend: the real `vllm.LLM` engine, colocated with the trainer.

Two ways to run it, chosen by `in_process` (default: in-process in a world of one process):

- in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, starts in seconds). Under torchrun this
  would hang (vLLM calls `new_group` over every rank), so it is refused when world > 1.
- engine processes (vLLM's default): tensors cannot pass through `collective_rpc`.

Weights reach the engine through a buffer in shared memory laid out as the HF model
(`weight_sync.shm`, in `shm_dir`, allocated at the first update and kept until shutdown: one
copy of the model in the update's dtype). The trainer's ranks write their shards into it
directly (`shared_weights`, then `load_shared_weights`); `update_weights` copies a checked
stream into it, so a bad update fails before the engine is touched. The worker extension
`weight_sync.vllm_worker.SharedWeightLoader` loads views of the same pages, in place on CPU
(`weight_sync.vllm_inplace`: half the time of vLLM's reload). The one exception is an
in-process engine on a GPU: there the trainer's device tensors stream straight into the
worker's `reload_weights`.

After every update the prefix cache is reset: cached KV blocks were computed with the old
weights (skipping it gave log-prob errors of about 10 on a 168-token prompt).

In-process vLLM changes process state the trainer relies on; `_TrainerState` restores it around
every engine call: the Python / numpy / torch RNG states (vLLM reseeds them, and sampling
without a per-request seed would draw from torch's), `torch.set_num_threads` (replaced by a
no-op) and the thread count, and the environment variables it overwrites. With engine
processes, `generate` and `prompt_logprobs` only talk to them, and skip it: a generation may then
run in a background thread while the trainer works (`rollout.async_steps`), and restoring the
RNG states at its end would roll back the trainer's.

With `cpu_cores` (rollout.placement=separate on CPU) the engine processes are bound to those
cores (`rollout.placement`): vLLM's workers through VLLM_CPU_OMP_THREADS_BIND, and every
thread of every engine process once they run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import signal
import tempfile
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import psutil
import torch
from torch import Tensor

from cwgrpo_megatron.rollout import placement
from cwgrpo_megatron.rollout.base import (
    ENGINE_DTYPES,
    Completion,
    EngineBase,
    EngineDeadError,
    RolloutGroup,
    SamplingConfig,
    check_sequences,
    checked_weights,
)
from cwgrpo_megatron.weight_sync import shm

log = logging.getLogger(__name__)

ENGINE_RECORDS = Path(tempfile.gettempdir()) / "cwgrpo-engines"
"""One JSON file per trainer process that owns engine processes: {pid: create_time} of each.
vLLM renames its processes (setproctitle), which wipes their visible environment, so they are
recorded rather than searched for."""
_RESTORED_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")
WATCHDOG_S = 0.5
"""How often a waiting call checks whether its engine processes were marked dead."""


class _TrainerState:
    """Saves what in-process vLLM changes in the trainer's process, restores it on exit."""

    def __enter__(self):
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.threads = torch.get_num_threads()
        self.set_num_threads = torch.set_num_threads
        self.env = {k: os.environ.get(k) for k in _RESTORED_ENV}
        return self

    def __exit__(self, *exc) -> None:
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        torch.set_num_threads = self.set_num_threads
        torch._C.set_num_threads(self.threads)
        for key, value in self.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop_engine_processes(llm, record: Path) -> None:
    llm.llm_engine.engine_core.shutdown()
    record.unlink(missing_ok=True)


def _record_engine_processes() -> tuple[Path, list[int]]:
    """Write this process's children (the engine processes just started) to its record; the
    record and their pids."""
    procs = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            procs[child.pid] = child.create_time()
    ENGINE_RECORDS.mkdir(exist_ok=True)
    record = ENGINE_RECORDS / f"{os.getpid()}.json"
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(procs))
    tmp.replace(record)
    return record, list(procs)


def kill_orphaned_engines() -> int:
    """SIGKILL the engine processes recorded by trainers that are gone (a SIGKILLed trainer
    leaves them running, about 1.5 GB each); returns how many were killed."""
    killed = 0
    for record in ENGINE_RECORDS.glob("*.json") if ENGINE_RECORDS.is_dir() else []:
        if psutil.pid_exists(int(record.stem)):
            continue
        try:
            procs = json.loads(record.read_text())
        except (OSError, ValueError):
            procs = {}
        for pid, created in procs.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                if abs(proc.create_time() - created) < 1e-3:  # not a reused pid
                    log.warning(
                        "killing engine process %s left by dead trainer %s", pid, record.stem
                    )
                    proc.send_signal(signal.SIGKILL)
                    killed += 1
        record.unlink(missing_ok=True)
    return killed


class VLLMEngine(EngineBase):
    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 2048,
        long_prompt: str = "error",
        in_process: bool | None = None,
        tensor_parallel_size: int = 1,
        kv_cache_bytes: int | None = 256 << 20,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = True,
        shm_dir: str = "/dev/shm",
        devices: Sequence[int] | None = None,
        weight_sync: str | None = None,
        cpu_cores: Sequence[int] | None = None,
    ) -> None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        self.in_process = (world == 1) if in_process is None else in_process
        if self.in_process and world > 1:
            raise ValueError(
                f"an in-process vLLM engine hangs in a world of {world} processes (vLLM builds "
                "groups over every rank); use in_process=False (engine processes)"
            )
        super().__init__(model_dir, seed=seed, max_model_len=max_model_len, long_prompt=long_prompt)
        self.shm_dir = shm_dir
        self.devices = None if devices is None else list(devices)
        """GPUs of this node (by index, as LOCAL_RANK counts them) that the engine processes
        run on; None: vLLM's choice (the first tensor_parallel_size visible ones)."""
        self.cpu_cores = None if cpu_cores is None or torch.cuda.is_available() else cpu_cores
        """The cores the engine processes are bound to (CPU only); None: unbound."""
        if self.cpu_cores is not None and self.in_process:
            raise ValueError("an in-process engine cannot be bound to cores of its own")
        self._buffer: shm.SharedWeights | None = None
        self._buffer_finalizer = None
        self.last_load: str | None = None
        """How the engine took the last buffer: "in_place" (`vllm_inplace`) or
        "reload" (vLLM's `reload_weights`); None before the first."""
        self._engine_args = dict(
            model=self.model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,
            # log-probs of the distribution sampled from: after temperature and top-k / top-p
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=enable_sleep_mode and torch.cuda.is_available(),
            worker_extension_cls="cwgrpo_megatron.weight_sync.vllm_worker.SharedWeightLoader",
        )
        if torch.cuda.is_available():
            self._engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # vLLM rewinds a seeded request's generator when a step splits its prompt's prefill,
            # and a CPU generator has no offset to rewind ("CPU Generator does not use
            # offset"): on CPU each prompt is prefilled in one step
            self._engine_args["enable_chunked_prefill"] = False
            self._engine_args["max_num_batched_tokens"] = max(max_model_len, 4096)
            if kv_cache_bytes is not None:
                self._engine_args["kv_cache_memory_bytes"] = kv_cache_bytes
        self.transfer = _transfer(weight_sync, in_process=self.in_process, devices=self.devices)
        """The vLLM weight transfer backend that updates arrive through (`receive`): "ipc"
        (`weight_sync.ipc`) or "nccl" (`weight_sync.nccl`); None: the /dev/shm buffer, or in
        one process on a GPU the trainer's own tensors."""
        if self.transfer is not None:
            self._engine_args["weight_transfer_config"] = {"backend": self.transfer}
        self.sleep_mode = self._engine_args["enable_sleep_mode"]
        self._finalizer = None
        if enable_sleep_mode and not self.sleep_mode:
            log.info("vLLM sleep mode is not supported on CPU: sleep() and wake() do nothing")
        self.llm = self._start()

    # ---- life cycle ------------------------------------------------------------------------

    def _start(self):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        if self._engine_args["enforce_eager"]:  # skips a 2-17 s compile of a helper
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        shm.remove_orphaned_buffers(self.shm_dir)
        if not self.in_process:
            kill_orphaned_engines()
        from vllm import LLM

        with _TrainerState(), _visible_devices(self.devices), self._omp_bind():
            llm = LLM(**self._engine_args)
        if not self.in_process:  # stop engine processes at exit even if the run fails
            record, pids = _record_engine_processes()
            self._finalizer = weakref.finalize(self, _stop_engine_processes, llm, record)
            if self.cpu_cores is not None:
                for pid in pids:
                    with contextlib.suppress(FileNotFoundError):
                        placement.bind_process(pid, self.cpu_cores)
        return llm

    @contextlib.contextmanager
    def _omp_bind(self):
        """VLLM_CPU_OMP_THREADS_BIND set to the engine's cores while its processes start."""
        if self.cpu_cores is None:
            yield
            return
        key, before = "VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        tp = self._engine_args["tensor_parallel_size"]
        os.environ[key] = placement.omp_bind(self.cpu_cores, tp)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before

    def _recover(self) -> None:
        """A failed reload leaves the engine unusable. In-process, reload the original weights
        from `model_dir` (a second in-process engine would clash with the first one's global
        groups); with engine processes, restart them. Either way the engine is back at
        version 0: the caller must push the trainer's weights again."""
        log.error("weight update failed: restoring the vLLM engine from %s", self.model_dir)
        self.version = 0
        if self.in_process:
            with _TrainerState():
                self.llm.collective_rpc("cwgrpo_reload")
            self.llm.reset_prefix_cache()
            return
        self.shutdown()
        self.llm = self._start()

    def shutdown(self) -> None:
        """Stop the engine. In-process, vLLM's teardown also destroys torch.distributed's
        default process group (it assumes it created it): call this after the trainer is done
        with its collectives and Megatron's groups (`parallel.destroy()`)."""
        if self.llm is None:
            return
        if self._buffer_finalizer is not None:
            self._buffer_finalizer()
            self._buffer, self._buffer_finalizer = None, None
        if self._finalizer is not None:
            self._finalizer()
        else:
            self.llm.llm_engine.engine_core.shutdown()
        self.llm, self._finalizer = None, None
        gc.collect()

    def sleep(self, level: int) -> None:
        """vLLM's sleep at `level` (1 or 2); nothing without sleep mode (on CPU). vLLM clears
        its prefix cache here, and keeps the model's buffers (rotary tables) in host memory
        at level 2, so the weight sync restores the whole model."""
        if self.sleep_mode and level > 0:
            self.llm.sleep(level=level)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        if self.sleep_mode:
            self.llm.wake_up(tags=None if tags is None else list(tags))

    # ---- sampling --------------------------------------------------------------------------

    def _params(self, n: int, sampling: SamplingConfig, seeds: list[int]):
        from vllm import SamplingParams

        return [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_tokens,
                logprobs=0,
                # vLLM seeds the n samples of a request seed, seed + 1, ...; a seed per request
                # also keeps sampling off the trainer's torch RNG
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutGroup]:
        prompts, cut = self._check_requests(prompt_token_ids, n, sampling)
        params = self._params(n, sampling, self._prompt_seeds(sampling, len(prompts), n, seeds))
        with self._guard(), self._alive():
            outputs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
        return [
            RolloutGroup(
                prompt_ids=prompt,
                completions=[_completion(c) for c in out.outputs],
                policy_version=self.version,
                truncated=was_cut,
            )
            for prompt, out, was_cut in zip(prompts, outputs, cut, strict=True)
        ]

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        check_sequences(sequences, max_model_len=self.max_model_len)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        with self._guard(), self._alive():
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False
            )
        return [
            [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
            for out, seq in zip(outputs, sequences, strict=True)
        ]

    def _guard(self):
        """`_TrainerState` around an in-process call; nothing around a call to engine processes,
        which leaves the trainer's state alone and may run beside it in another thread."""
        return _TrainerState() if self.in_process else contextlib.nullcontext()

    @contextlib.contextmanager
    def _alive(self):
        """vLLM's EngineDeadError as ours, with what to do about it. vLLM 0.32's client waits
        forever for engine processes that die mid-call (its monitor marks the engine dead and
        stops the output thread without a word to a waiting request or RPC), so a watchdog
        hands the waiting call vLLM's own error once the engine is marked dead."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        done = threading.Event()
        if not self.in_process:
            client = self.llm.llm_engine.engine_core

            def watch() -> None:
                while not done.wait(WATCHDOG_S):
                    if client.resources.engine_dead:
                        client.outputs_queue.put_nowait(VLLMEngineDead())  # a request
                        for future in list(client.utility_results.values()):  # an RPC
                            if not future.done():
                                future.set_exception(VLLMEngineDead())
                        return

            threading.Thread(target=watch, daemon=True, name="cwgrpo-engine-watchdog").start()
        try:
            yield
        except VLLMEngineDead as err:
            raise EngineDeadError(
                f"the vLLM engine processes of rank {_global_rank()} died (a crash, the OOM "
                "killer or a kill; vLLM's log above says which): start the run again, it "
                "resumes from its last checkpoint"
            ) from err
        finally:
            done.set()

    # ---- weights ---------------------------------------------------------------------------

    @property
    def buffered(self) -> bool:
        """`update_weights` and the shared-memory path go through the buffer (all but an
        in-process GPU engine, which reads the trainer's tensors themselves). An engine with a
        `transfer` has the buffer too, for syncs whose shards cross nodes."""
        return not (self.in_process and torch.cuda.is_available())

    def receive(self, send) -> None:
        """Load the weights that `send(llm)` transfers into this engine through vLLM's weight
        transfer (`weight_sync.ipc` or `.nccl`: every rank of the job sends at once, this
        engine's owner with its `vllm.LLM`)."""
        if self.transfer is None:
            raise RuntimeError("this engine was not started for vLLM's weight transfer")
        self._load(lambda: send(self.llm))
        self.last_load = self.transfer

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        stream = checked_weights(weights, self.shapes)
        if not self.buffered:
            self._load(lambda: self.llm.collective_rpc("cwgrpo_reload", args=(stream,)))
            return
        # a bad tensor fails here, before the engine is touched
        buffer = self._buffer or self.shared_weights(ENGINE_DTYPES[self._engine_args["dtype"]])
        shm.fill(buffer, stream)
        self.load_shared_weights()

    def shared_weights(self, dtype: torch.dtype) -> shm.SharedWeights | None:
        if not self.buffered:
            return None  # the worker reads the trainer's device tensors themselves
        if self._buffer is None or self._buffer.torch_dtype != dtype:
            if self._buffer_finalizer is not None:
                self._buffer_finalizer()
            self._buffer = shm.create(self.shapes, dtype, folder=self.shm_dir)
            self._buffer_finalizer = weakref.finalize(self, shm.remove, self._buffer)
        return self._buffer

    def load_shared_weights(self) -> None:
        if self._buffer is None:
            raise RuntimeError("load_shared_weights before shared_weights: nothing was written")
        message = self._buffer.to_message()
        loads = self._load(lambda: self.llm.collective_rpc("cwgrpo_load_shared", args=(message,)))
        self.last_load = loads[0]

    def _load(self, call):
        """Run the engine-side load `call`, then reset the prefix cache and bump the version;
        a failed load rebuilds the engine (`_recover`) and re-raises; dead engine processes
        raise EngineDeadError."""
        try:
            with _TrainerState(), self._alive():
                result = call()
        except EngineDeadError:
            raise  # nothing to restore: the processes are gone, and the run stops
        except BaseException:
            self._recover()
            raise
        self.llm.reset_prefix_cache()
        self.version += 1
        return result


def _transfer(
    weight_sync: str | None, *, in_process: bool, devices: list[int] | None
) -> str | None:
    """rollout.weight_sync as this engine's vLLM weight transfer backend. Unset: ipc on GPUs
    with engine processes. shm, an in-process GPU engine (it reads the trainer's tensors
    directly) and CPU (no CUDA IPC or NCCL) take none. nccl needs the engine on GPUs other than
    this rank's: NCCL refuses two ranks of one group on one GPU."""
    cuda = torch.cuda.is_available()
    if weight_sync in ("ipc", "nccl") and (in_process or not cuda):
        raise ValueError(
            f"rollout.weight_sync={weight_sync} needs a GPU and engine processes: leave it unset "
            "(ipc on GPUs, shm on CPU) or set shm"
        )
    if weight_sync == "nccl" and (devices is None or torch.cuda.current_device() in devices):
        raise ValueError(
            "rollout.weight_sync=nccl needs the engine on GPUs the trainer does not use: set "
            "rollout.placement=separate, or leave rollout.weight_sync unset"
        )
    if weight_sync == "shm" or in_process or not cuda:
        return None
    return weight_sync or "ipc"


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _visible_devices(devices: list[int] | None):
    """CUDA_VISIBLE_DEVICES narrowed to `devices` (indices into what is visible now) while vLLM
    starts its engine processes, which inherit it; restored afterwards."""
    if devices is None or not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in devices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _completion(output) -> Completion:
    ids = list(output.token_ids)
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {output.finish_reason!r}")
    logprobs = [step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)]
    return Completion(ids, logprobs, output.finish_reason)
