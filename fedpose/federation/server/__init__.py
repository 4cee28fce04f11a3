"""The coordinator's side of the federation, Flower-free: the round loop and the basis service.

``coordinator/`` adapts these to Flower (a Grid transport and the ServerApp); nothing here
imports Flower, so the round logic is tested with an in-process transport.
"""
