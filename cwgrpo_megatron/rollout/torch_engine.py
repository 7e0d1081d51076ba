"""The `torch` rollout backend: plain-torch sampling with a KV cache on an HF transformers
model, for machines without vLLM (and the benchmark's baseline).

Prompts of different lengths are left-padded into one batch, each repeated n times, and decoded
together, one token per forward pass through the model's KV cache. Per step:

    z = logits / temperature -> keep the top-k, then the top-p set (others -inf)
    token ~ softmax(z),   logprob = log_softmax(z)[token]

so log-probs are those of the distribution sampled from, like vLLM's `processed_logprobs`.
Each row draws from its own generator, seeded with its prompt's seed + its sample index (as
vLLM seeds a request's n samples), so a sample does not depend on what else is in the batch;
sampling never advances the trainer's RNG.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from cwgrpo_megatron.rollout.base import (
    ENGINE_DTYPES,
    Completion,
    EngineBase,
    RolloutGroup,
    SamplingConfig,
    check_sequences,
    checked_weights,
)


def filter_logits(z: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """`z` [rows, V] with every token outside the top-k (k > 0), then outside the smallest set
    of probability >= top_p, set to -inf. The most likely token is always kept."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


class TorchEngine(EngineBase):
    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 2048,
        long_prompt: str = "error",
        device: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(model_dir, seed=seed, max_model_len=max_model_len, long_prompt=long_prompt)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=ENGINE_DTYPES[dtype])
        self.model = model.to(self.device).eval().requires_grad_(False)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        self.eos = torch.tensor(
            [] if eos is None else [eos] if isinstance(eos, int) else list(eos), device=self.device
        )
        self.pad = int(self.eos[0]) if len(self.eos) else 0

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutGroup]:
        prompts, cut = self._check_requests(prompt_token_ids, n, sampling)
        prompt_seeds = self._prompt_seeds(sampling, len(prompts), n, seeds)
        rows = [p for p in prompts for _ in range(n)]
        row_seeds = [s + j for s in prompt_seeds for j in range(n)]
        tokens, logps, lengths, stopped = self._sample(rows, sampling, row_seeds)
        groups = []
        for i, (prompt, was_cut) in enumerate(zip(prompts, cut, strict=True)):
            completions = []
            for r in range(i * n, (i + 1) * n):
                k = lengths[r]
                completions.append(
                    Completion(tokens[r][:k], logps[r][:k], "stop" if stopped[r] else "length")
                )
            groups.append(RolloutGroup(prompt, completions, self.version, was_cut))
        return groups

    @torch.no_grad()
    def _sample(self, rows: list[list[int]], sampling: SamplingConfig, seeds: list[int]):
        """(tokens, logps, lengths, stopped) per row, as Python lists; row r draws from a
        generator seeded with seeds[r]."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        length = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        out_tokens, out_logps = [], []
        past, step_ids, step_pos = None, ids, positions
        for _ in range(sampling.max_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            z = filter_logits(
                out.logits[:, -1].float() / sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
            )
            logp = torch.log_softmax(z, dim=-1)
            probs = logp.exp()
            token = torch.cat(
                [torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)]
            )
            token = torch.where(done, self.pad, token)
            out_tokens.append(token)
            out_logps.append(logp.gather(-1, token[:, None]).squeeze(-1))
            length += (~done).long()
            done |= torch.isin(token, self.eos)
            if bool(done.all()):
                break
            step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        tokens = torch.stack(out_tokens, 1).tolist()
        logps = torch.stack(out_logps, 1).tolist()
        return tokens, logps, length.tolist(), done.tolist()

    @torch.no_grad()
    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        check_sequences(sequences, max_model_len=self.max_model_len)
        result = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], device=self.device)
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), -1)
            result.append(logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
        return result

    @torch.no_grad()
    def load_stream(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        staged = {}  # copy only once the whole update has been checked: never a mixed policy
        for name, tensor in checked_weights(weights, self.shapes):
            staged[name] = tensor.to(self.device, params[name].dtype, copy=True)
        for name, tensor in staged.items():
            params[name].copy_(tensor)
        self.version += 1

    def sleep(self, level: int) -> None:
        pass  # a test and fallback engine: it keeps its model where it is

    def wake(self, tags: Sequence[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None
