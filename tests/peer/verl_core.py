"""Loads verl's `verl/trainer/ppo/core_algos.py` (PyPI `verl`) as a standalone module.

The `verl` package's `__init__` files pull in ray and a training stack, so the package is never
imported. The wheel is fetched with `pip download --no-deps`, the one file is read from it, and
its imports of other verl modules (and of omegaconf, which only its type hints need) are
satisfied by the small stand-ins below, written here for that purpose. Nothing of verl is copied
into this project; the file is read from the wheel at test time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import torch

VERL_VERSION = "0.9.1"
CORE_ALGOS = "verl/trainer/ppo/core_algos.py"
_CACHE = Path(os.environ.get("CWGRPO_PEER_DIR", Path(sys.prefix) / "peer-wheels"))


class PeerUnavailable(RuntimeError):
    """The wheel could not be fetched (no network, no PyPI)."""


def cached_wheel(cache: Path = _CACHE) -> Path | None:
    """The verl wheel if it has been fetched into `cache`, else None."""
    found = sorted(cache.glob(f"verl-{VERL_VERSION}-*.whl"))
    return found[0] if found else None


def fetch_wheel(cache: Path = _CACHE, *, timeout_s: float = 300.0) -> Path:
    """The verl wheel, downloaded into `cache` on first use (`pip download` in a subprocess)."""
    if (found := cached_wheel(cache)) is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache)]
    try:
        done = subprocess.run(
            [*cmd, f"verl=={VERL_VERSION}"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PeerUnavailable(f"pip download verl=={VERL_VERSION} failed: {err}") from err
    found = cached_wheel(cache)
    if done.returncode != 0 or found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PeerUnavailable(f"pip download verl=={VERL_VERSION} failed: {' / '.join(tail)}")
    return found


# ---- stand-ins for the modules core_algos.py imports -----------------------------------------


def _masked_sum(values, mask, axis=None):
    # verl's contract: values outside the mask never reach the sum, even NaN ones
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _masked_mean(values, mask, axis=None):
    # verl's contract: the denominator carries a 1e-8 guard
    return _masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _not_needed(name):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"the parity stand-in for verl's {name} is not implemented")

    return fail


def _identity_decorator(*args, **kwargs):
    return lambda fn: fn


class ActorConfig:
    """The fields of verl's actor config that the policy losses read."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def get(self, key, default=None):
        return getattr(self, key, default)


class _Marker:
    """A type that only appears in annotations and isinstance checks."""


def _stand_in_modules() -> dict[str, types.ModuleType]:
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        return mod

    return {
        "omegaconf": module("omegaconf", DictConfig=type("DictConfig", (_Marker,), {})),
        "verl": module("verl"),
        "verl.utils": module(
            "verl.utils",
            as_torch_index=_not_needed("as_torch_index"),
            group_mean_std=_not_needed("group_mean_std"),
        ),
        "verl.utils.torch_functional": module(
            "verl.utils.torch_functional", masked_sum=_masked_sum, masked_mean=_masked_mean
        ),
        "verl.utils.import_utils": module(
            "verl.utils.import_utils", deprecated=_identity_decorator
        ),
        "verl.trainer": module("verl.trainer"),
        "verl.trainer.config": module(
            "verl.trainer.config", AlgoConfig=type("AlgoConfig", (_Marker,), {})
        ),
        "verl.workers": module("verl.workers"),
        "verl.workers.config": module("verl.workers.config", ActorConfig=ActorConfig),
    }


def load_core_algos(wheel: Path) -> types.ModuleType:
    """core_algos.py from `wheel`, executed with the stand-ins visible only while it imports."""
    source = zipfile.ZipFile(wheel).read(CORE_ALGOS).decode()
    stand_ins = _stand_in_modules()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        core = types.ModuleType("verl_core_algos")
        core.__file__ = f"{wheel}!{CORE_ALGOS}"
        exec(compile(source, core.__file__, "exec"), core.__dict__)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return core


def actor_config(**overrides) -> ActorConfig:
    """verl's defaults (clip 0.2, dual-clip 3, Clip-Cov / KL-Cov defaults), with overrides."""
    policy_loss = ActorConfig(
        clip_cov_ratio=overrides.pop("clip_cov_ratio", 2e-4),
        clip_cov_lb=overrides.pop("clip_cov_lb", 1.0),
        clip_cov_ub=overrides.pop("clip_cov_ub", 5.0),
        kl_cov_ratio=overrides.pop("kl_cov_ratio", 2e-4),
        ppo_kl_coef=overrides.pop("ppo_kl_coef", 1.0),
    )
    fields = dict(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
        clip_ratio_c=3.0,
        policy_loss=policy_loss,
        global_batch_info={},
    )
    fields.update(overrides)
    return ActorConfig(**fields)


if __name__ == "__main__":  # `make` fetches the wheel before pytest, so the unit tier need not
    print(fetch_wheel())
