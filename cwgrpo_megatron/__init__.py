"""Covariance-Aware GRPO (CW-GRPO) for Qwen2-family models on Megatron-Core.

Layout (see DESIGN):
    config      typed, keyword-only config dataclasses; YAML holds overrides only
    algo/       pure tensor math: advantages, covariance weights, policy losses, KL
    comm/       the only door to collectives (explicit process groups, None = this process)
"""

__version__ = "0.1.0"
