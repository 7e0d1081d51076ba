"""The `vllm` rollout backend: the real `vllm.LLM` engine (generate, score, sleep, wake),
colocated with the trainer or on devices of its own (rollout.placement).

Two ways to run it, chosen by `in_process` (default: in-process in a world of one process):

- in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, starts in seconds). Under torchrun this
  would hang (vLLM calls `new_group` over every rank), so it is refused when world > 1.
- engine processes (vLLM's default): tensors cannot pass through `collective_rpc`. Their
  supervision (where they start, the record of them, the watchdog) is `vllm_processes`.

The receiving side of each weight path is `vllm_weights.VLLMWeights`.

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
import logging
import os
import random
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from cwgrpo_megatron.comm import job_rank, size_of, world_group
from cwgrpo_megatron.rollout import placement, vllm_processes
from cwgrpo_megatron.rollout.base import (
    Completion,
    EngineBase,
    RolloutGroup,
    SamplingConfig,
    check_sequences,
)
from cwgrpo_megatron.rollout.vllm_weights import VLLMWeights, engine_sync_path
from cwgrpo_megatron.weight_sync import shm
from cwgrpo_megatron.weight_sync.names import TRANSFER_PATHS

log = logging.getLogger(__name__)

_RESTORED_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")


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


class VLLMEngine(VLLMWeights, EngineBase):
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
        world = size_of(world_group())
        self.rank = job_rank()
        """This process's rank in the job (named in the error of dead engine processes)."""
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
        self.sync_path = engine_sync_path(
            weight_sync, in_process=self.in_process, devices=self.devices
        )
        if self.sync_path in TRANSFER_PATHS:
            self._engine_args["weight_transfer_config"] = {"backend": self.sync_path}
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
            vllm_processes.kill_orphaned_engines()
        from vllm import LLM

        tp = self._engine_args["tensor_parallel_size"]
        with _TrainerState(), vllm_processes.started(self.devices, self.cpu_cores, tp):
            llm = LLM(**self._engine_args)
        if not self.in_process:  # stop engine processes at exit even if the run fails
            record, pids = vllm_processes.record_engine_processes()
            stop = vllm_processes.stop_engine_processes
            self._finalizer = weakref.finalize(self, stop, llm, record)
            if self.cpu_cores is not None:
                for pid in pids:
                    with contextlib.suppress(FileNotFoundError):
                        placement.bind_process(pid, self.cpu_cores)
        return llm

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
        self._stop()
        self.llm = self._start()  # the buffer stays: the trainer's sender holds its address

    def shutdown(self) -> None:
        """Stop the engine. In-process, vLLM's teardown also destroys torch.distributed's
        default process group (it assumes it created it): call this after the trainer is done
        with its collectives and Megatron's groups (`parallel.destroy()`)."""
        if self.llm is None:
            return
        self._release_buffer()
        self._stop()

    def _stop(self) -> None:
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
        outputs = self._guarded(
            lambda: self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
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
        outputs = self._guarded(
            lambda: self.llm.generate(
                [{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False
            )
        )
        return [
            [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
            for out, seq in zip(outputs, sequences, strict=True)
        ]

    def _guarded(self, call, *, restore: bool = False):
        """`call()` under the watchdog (`vllm_processes.watched`), and under `_TrainerState`
        in-process or with `restore` (every load). A call to engine processes leaves the
        trainer's state alone and may run beside it in another thread."""
        guard = _TrainerState() if self.in_process or restore else contextlib.nullcontext()
        with guard, vllm_processes.watched(self.llm, rank=self.rank, in_process=self.in_process):
            return call()


def _completion(output) -> Completion:
    ids = list(output.token_ids)
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {output.finish_reason!r}")
    logprobs = [step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)]
    return Completion(ids, logprobs, output.finish_reason)
