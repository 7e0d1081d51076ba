"""A run's files and metrics: the run folder, the metrics line, and where metrics go."""
