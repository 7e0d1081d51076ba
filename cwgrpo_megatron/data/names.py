"""Prompt-data formats by name, declared apart from their readers: settings (`data/config.py`)
check a name here, and `data/prompts.py` / `data/synthetic.py` register the implementations
when imported."""

from cwgrpo_megatron.common.registry import Registry

SCHEMAS = Registry("dataset schema", defined_in="cwgrpo_megatron.data.prompts")
SYNTHETIC_TASKS = Registry("synthetic task", defined_in="cwgrpo_megatron.data.synthetic")
CHAT_TEMPLATES = ("auto", "qwen2.5", "r1_distill", "plain")
"""auto: the tokenizer's own template, else qwen2.5; the others force one."""
