"""Flower-free federation logic used by ``sites/`` and ``coordinator/``.

- :mod:`.config` — SiteConfig (only what a site reads), CoordinatorConfig, FederationConfig (pydantic).
- :mod:`.site_budget` — the site's persisted, crash-safe ε budget guard (refuses rounds past ε_max).
- :mod:`.ledger` — the coordinator's SQLite mirror of what each site reported.
- :mod:`.validation` — rejects NaN/Inf, wrong shape/dtype and over-norm updates.
- :mod:`.aggregation` — streaming weighted FedAvg + server optimizers (FedAvg, FedAvgM, FedAdam).
- :mod:`.basis_transport` — ships the projection basis V: full arrays or a compact recipe.
- :mod:`.metrics` — per-process Prometheus registries for coordinator and site.
- :mod:`.protocol` — the round protocol: TrainInstruction, SiteReply, PrivacyReport (the only schema).
- :mod:`.local_training` — one site's round: budget guard, data, private training, the reply.
- :mod:`.report` — the typed round history (RoundRecord, SiteRoundRecord), report.json, curves.
- :mod:`.server` — the coordinator's round runner (over any transport) and its basis service.

Model weights and updates are ``dict[str, np.ndarray]`` ("ArrayDict"): name → float32 array, in
the order of the global model's ``state``/trainable parameters. Nothing here imports Flower.
"""
