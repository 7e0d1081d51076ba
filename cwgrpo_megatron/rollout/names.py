"""The rollout backends by name, declared apart from their implementations (`rollout/__init__.py`
registers them, each importing its engine only when asked for): settings
(`rollout/config.py`) check a name here."""

from cwgrpo_megatron.common.registry import Registry

ROLLOUT_BACKENDS = Registry("rollout backend", defined_in="cwgrpo_megatron.rollout")
LONG_PROMPT_POLICIES = ("error", "truncate")
"""What an engine does with a prompt that leaves no room for max_tokens."""
