"""fedpose: federated, differentially private 2D human-pose estimation.

The library never imports Flower; `coordinator/` and `sites/` are thin Flower apps over it.
"""

__version__ = "0.1.0"
