"""Secure aggregation (SecAgg+, Bell et al. 2020, over the full graph): the coordinator learns only
the sum of the sites' updates.

``quantization`` (clip, stochastic rounding, modulus: no overflow by construction), ``crypto`` (the
one adapter to Flower's SecAgg+ primitives), ``site`` (a site's state machine and the security
rule), ``coordinator`` (routing, dropout recovery, the unmasked sum). The round runner drives the
four stages (:mod:`fedpose.federation.server.rounds`); the wire messages are in
:mod:`fedpose.federation.protocol`. Each site's guarantee stays its own local (ε, δ): secure
aggregation hides Δ from the coordinator, it adds no privacy accounting (no distributed DP).
"""
