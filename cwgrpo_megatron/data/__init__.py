"""Prompt data and the batch contract of the training step."""
