"""What every package may use, and which imports nothing of the package: name registries,
settings checks, files written atomically, per-phase timers."""
