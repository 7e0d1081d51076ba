"""The rewards by name, declared apart from their implementations (`reward/__init__.py`
registers them when imported): settings (`reward/config.py`) check a name here."""

from cwgrpo_megatron.common.registry import Registry

REWARDS = Registry("reward", defined_in="cwgrpo_megatron.reward")
VERIFIERS = ("accuracy", "integer_answer")
"""What decides that a completion is correct: math-verify, or the first integer."""
