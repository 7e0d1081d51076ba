"""The trainer's parts (inputs, rollouts, weight sync), each built from a run's config.

    inputs     the start checkpoint's architecture, tokenizer, prompt format, prompts, benchmarks
    rollouts   prompt sampler + engine replicas + this rank's engine + reward: steps 1-3
    sync       weight-sync plan + verifier: step 10

A part that holds a resource registers its release on the ExitStack it is built with, so that
`build.build_trainer` declares the shutdown order once.
"""
