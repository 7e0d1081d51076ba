"""The algorithm's swappable parts by name, declared apart from their implementations: settings
(`algo/config.py`) check a name here without importing them, and each implementation module
registers itself when it is imported (`Registry`'s `defined_in`)."""

from cwgrpo_megatron.common.registry import Registry

POLICY_LOSSES = Registry("policy loss", defined_in="cwgrpo_megatron.algo.losses")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", defined_in="cwgrpo_megatron.algo.advantages")
KL_ESTIMATORS = Registry("KL estimator", defined_in="cwgrpo_megatron.algo.kl")
LOSS_AGGREGATIONS = Registry("loss aggregation", defined_in="cwgrpo_megatron.algo.aggregation")
SCOPE_NAMES = ("global", "group", "micro_batch")
"""The token pools of the covariance statistics (`algo.scope`)."""
STATS_LOGP = ("trainer", "rollout")
"""Where the covariance statistics' log-probs come from (`AlgoConfig.stats_logp`)."""
