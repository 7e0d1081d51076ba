"""What a first GPU run would find, found on CPU (issue 28's sweep).

- **Tensors on one device.** The step's math (advantages, every policy loss at every scope,
  with KL, truncated IS and dual-clip, the backward pass), the metrics reduction and their
  finalisation run with every input on the `meta` device. A constant made on the host, which
  would stop the step on a GPU with "Expected all tensors to be on the same device", stops it
  here too; the first test shows that premise.
- **Transformer Engine's parameter names.** Every call that names Megatron's parameters says
  which layer spec the model has: `te_spec` has no default, and the package's source is read
  to check that the calls which only run on a GPU pass it too.
- **Resume with TE's Adam.** torch's Adam (Megatron's fallback without TE / apex) gets the
  per-parameter `step` it needs before a distributed-optimizer load; TE's FusedAdam, whose
  `state_dict` refuses any per-parameter key but its own, gets none.

What the meta device cannot reach, and why:
- Megatron's forward pass: under `megatron/cpu.py`'s CPU redirection the rotary frequencies
  are made on the host, a stand-in artefact that a GPU run does not have. Token ids made on the
  host are moved to the model's device in `forward.forward_only` and `publish.score`, by
  reading.
- Collectives (gloo refuses meta tensors) and code that needs values (`.item()`, `.cpu()`,
  `.tolist()`): the weight-sync check's comparison, the train step's logging.
"""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cwgrpo_megatron.algo import PolicyBatch, get_policy_loss
from cwgrpo_megatron.algo.advantages import get_advantage_estimator
from cwgrpo_megatron.algo.metrics import finalize, histograms, merge
from cwgrpo_megatron.comm import reduce_metrics
from cwgrpo_megatron.comm.scopes import LayoutDependentWarning, make_scope
from cwgrpo_megatron.config import AlgoConfig
from tests.unit.test_losses import make_batch

PACKAGE = Path(__file__).resolve().parents[2] / "cwgrpo_megatron"
DEVICE = torch.device("meta")


def test_the_meta_device_stops_a_host_constant_as_a_gpu_would():
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(3, device=DEVICE) * torch.tensor([1.0, 2.0, 3.0])


def _scope(name: str, rows: int):
    """The scope the train step builds, moved to the device. torch.unique (group and
    micro-batch pools) has no meta kernel, so the pools are found on the host first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutDependentWarning)
        scope = make_scope(
            name,
            batch_size=rows,
            prompt_index=torch.arange(rows) // 2,
            micro_batch_index=torch.arange(rows) // 3,
            row_order=torch.arange(rows),
        )
    return dataclasses.replace(
        scope, segment=scope.segment.to(DEVICE), row_order=scope.row_order.to(DEVICE)
    )


EXTRAS = {
    "plain": {},
    "kl-tis-dual": dict(kl_beta=0.04, tis_cap=2.0, clip_ratio_c=3.0),
    "kl-tis": dict(kl_beta=0.04, tis_cap=2.0),  # kl_cov does not clip, so no dual-clip
}
CASES = [
    (loss, scope, extra)
    for loss in ("grpo", "cw_grpo", "clip_cov", "kl_cov")
    for scope in ("global", "group", "micro_batch")
    for extra in (("plain", "kl-tis") if loss == "kl_cov" else ("plain", "kl-tis-dual"))
]


@pytest.mark.parametrize(("loss_name", "scope_name", "extra"), CASES)
def test_a_step_of_math_and_its_metrics_stay_on_the_inputs_device(loss_name, scope_name, extra):
    logp, old, ref, adv, mask = (t.float().to(DEVICE) for t in make_batch())
    cfg = AlgoConfig(policy_loss=loss_name, cov_scope=scope_name, **EXTRAS[extra])
    loss = get_policy_loss(loss_name)
    generator = torch.Generator().manual_seed(0)  # the train step's, on the host
    prepared = loss.prepare(
        old, adv, mask, scope=_scope(scope_name, mask.shape[0]), cfg=cfg, old_logp=old,
        generator=generator,
    )  # fmt: skip
    leaf = logp.clone().requires_grad_()
    out = loss(
        PolicyBatch(
            logp=leaf,
            old_logp=old,
            advantages=adv,
            mask=mask,
            token_stat=prepared.token_stat,
            ref_logp=ref,
            rollout_logp=old if cfg.tis_cap else None,
        ),
        cfg,
    )
    (out.loss_sum / out.num_tokens).backward()
    reduced = reduce_metrics(merge(prepared.metrics, out.metrics), group=None)
    values = {**finalize(reduced), **histograms(reduced)}
    assert leaf.grad.device == DEVICE and values
    assert {v.device for v in values.values()} == {DEVICE}


@pytest.mark.parametrize("std_normalize", [True, False])
def test_advantages_stay_on_the_rewards_device(std_normalize):
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]]).to(DEVICE)
    estimator = get_advantage_estimator("grpo")
    assert estimator(rewards, std_normalize=std_normalize, eps=1e-6).device == DEVICE


# ---- Transformer Engine's parameter names -----------------------------------------------

SPEC_CALLS = {"stage_params", "layer_rules", "received_bytes", "write_shards", "ExportGroups"}


def test_every_call_that_names_parameters_says_which_layer_spec():
    """GPU-only paths (TE installed) never run here, so the source is read: a call without
    `te_spec` would name a TE model's norms as the local spec's, and export or sync by the
    wrong names."""
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            keywords = {k.arg for k in node.keywords}
            if name in SPEC_CALLS and "te_spec" not in keywords and None not in keywords:
                missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    assert not missing, f"calls that do not say the layer spec: {missing}"


# ---- resume with TE's Adam -----------------------------------------------------------------


def _adam_state_init(opt, config=None):
    """What Megatron's init_state_fn does for Adam (megatron/core/optimizer/__init__.py)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["exp_avg"] = torch.zeros_like(p)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)


class TEFusedAdamContract(torch.optim.Optimizer):
    """The state-dict contract of Transformer Engine's FusedAdam: the step is kept per group,
    and `state_dict` unscales each per-parameter state through `get_unscaled_state`, which
    knows only these names (a KeyError otherwise)."""

    NAMES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3, "step": 0})

    def get_unscaled_state(self, param, state_name):
        dtype = self.NAMES[state_name]
        return self.state[param][state_name].to(dtype)

    def state_dict(self):
        for p, state in self.state.items():
            for name in state:
                self.get_unscaled_state(p, name)
        return super().state_dict()


@pytest.mark.parametrize("kind", ["torch", "te"])
def test_only_torch_adam_gets_a_per_parameter_step(kind):
    from cwgrpo_megatron.megatron.train_checkpoint import _ensure_optimizer_state

    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    inner = torch.optim.AdamW(params) if kind == "torch" else TEFusedAdamContract(params)
    wrapper = SimpleNamespace(optimizer=inner, init_state_fn=_adam_state_init, config=None)
    _ensure_optimizer_state(wrapper)
    keys = {frozenset(inner.state[p]) for p in params}
    if kind == "torch":
        assert keys == {frozenset({"exp_avg", "exp_avg_sq", "step"})}
    else:
        assert keys == {frozenset({"exp_avg", "exp_avg_sq"})}
    inner.state_dict()  # what a checkpoint save calls; TE's raised KeyError('step') before


# ---- the model's settings on a GPU ------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_fusions_are_on_with_transformer_engine_and_off_without(te, tp, moe):
    """The builder's flags for (local | te) x tp: TE is only chosen with CUDA
    (`use_transformer_engine`), so cpu x te does not occur; sequence parallelism is on at
    tp > 1 with TE, and on the local spec for a MoE model, whose layer needs it."""
    from cwgrpo_megatron.megatron.model import fusion_settings

    flags = fusion_settings(te=te, tp=tp, moe=moe)
    fusions = ("bias_activation_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")
    assert set(flags) == {*fusions, "sequence_parallel"}
    assert {flags[name] for name in fusions} == {te}
    assert flags["sequence_parallel"] is ((te or moe) and tp > 1)


def test_the_cpu_model_is_built_without_fusions():
    """On this machine (no CUDA) the builder picks the local spec's settings, which the CPU
    check accepts."""
    from cwgrpo_megatron.checks.tiny import TINY_QWEN2
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.megatron.model import transformer_config, use_transformer_engine

    assert not use_transformer_engine()
    config = transformer_config(ModelArch.from_hf_dict(TINY_QWEN2), tp=2, pp=1)
    assert not (config.bias_activation_fusion or config.apply_rope_fusion)
    assert not config.gradient_accumulation_fusion


@pytest.mark.parametrize(
    ("setting", "cuda", "expected"),
    [(None, False, True), (None, True, False), (True, True, True), (False, False, False)],
)
def test_vllm_compiles_by_default_on_a_gpu_and_stays_eager_on_cpu(setting, cuda, expected):
    from cwgrpo_megatron.rollout import RolloutConfig, eager

    assert eager(RolloutConfig(enforce_eager=setting), cuda=cuda) is expected


@pytest.mark.parametrize(
    ("cuda", "expected"),
    [(False, 0), (True, 2)],
)
def test_engines_sleep_by_default_on_a_gpu_and_not_on_cpu(cuda, expected):
    from cwgrpo_megatron.rollout import RolloutConfig, engine_sleep_level

    assert engine_sleep_level(RolloutConfig(), cuda=cuda) == expected
    assert engine_sleep_level(RolloutConfig(sleep_level=1), cuda=cuda) == 1
    with pytest.raises(ValueError, match="rollout.sleep_level=3 is not allowed.*0, 1, 2"):
        RolloutConfig(sleep_level=3)


@pytest.mark.parametrize(
    ("setting", "cuda", "in_process", "devices", "expected"),
    [
        (None, True, False, None, "ipc"),  # engine processes on GPUs: CUDA IPC
        ("ipc", True, False, [0], "ipc"),
        ("nccl", True, False, [1], "nccl"),  # an engine on a GPU of its own (this rank: GPU 0)
        (None, True, False, [1, 2], "nccl"),  # separate placement: from the owner's GPU
        ("shm", True, False, None, "shm"),  # the host-memory buffer, on request
        (None, True, True, None, "stream"),  # in-process on a GPU: the trainer's own tensors
        (None, False, False, None, "shm"),  # CPU: the /dev/shm buffer
        ("shm", False, False, None, "shm"),
    ],
)
def test_the_weight_sync_path_is_chosen_by_device(
    monkeypatch, setting, cuda, in_process, devices, expected
):
    from cwgrpo_megatron.rollout.vllm_weights import engine_sync_path

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert engine_sync_path(setting, in_process=in_process, devices=devices) == expected


@pytest.mark.parametrize(
    ("setting", "cuda", "in_process", "devices", "message"),
    [
        ("ipc", False, False, None, "weight_sync=ipc needs a GPU and engine processes"),
        ("ipc", True, True, None, "weight_sync=ipc needs a GPU and engine processes"),
        ("nccl", False, False, [1], "weight_sync=nccl needs a GPU and engine processes"),
        ("nccl", True, False, [0, 1], "needs the engine on GPUs the trainer does not use"),
        ("nccl", True, False, None, "needs the engine on GPUs the trainer does not use"),
    ],
)
def test_a_transfer_where_it_cannot_work_is_refused(
    monkeypatch, setting, cuda, in_process, devices, message
):
    from cwgrpo_megatron.rollout.vllm_weights import engine_sync_path

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=message):
        engine_sync_path(setting, in_process=in_process, devices=devices)


def test_the_log_prob_chunk_is_chosen_by_device():
    """A GPU takes 16x larger chunks (each costs about ten kernel launches); the planner
    counts the GPU's."""
    from cwgrpo_megatron.analysis.planner import LOGPROB_CHUNK_ELEMENTS
    from cwgrpo_megatron.comm.vocab_parallel import chunk_elements

    cpu, gpu = chunk_elements(torch.device("cpu")), chunk_elements(torch.device("cuda", 0))
    assert gpu == 16 * cpu == LOGPROB_CHUNK_ELEMENTS
    # [8192, 152064 / 2] logits: 10 chunks on a GPU, 149 on CPU
    rows = 8192 * 76032
    assert -(-rows // gpu) == 10 and -(-rows // cpu) == 149
