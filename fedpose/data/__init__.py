"""Pose data: the annotation schema, the synthetic generator, real-data loaders and transforms."""
