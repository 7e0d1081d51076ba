"""Arithmetic behind the planning and analysis tools: GPU memory plans, run comparisons."""
