"""fedpose: federated, differentially private 2D human-pose estimation.

The library never imports Flower; `coordinator/` and `sites/` are thin Flower apps over it
(`fedpose simulate` hands the run to `coordinator.simulation` by one lazy import; tests/test_layout.py).
"""

__version__ = "0.1.0"
