"""Privacy: RDP accountant, DP-SGD gradient engine and its mechanisms, public feature maps ψ.

Knows nothing of Flower, files or the CLI. Import the submodules directly
(``fedpose.privacy.accountant``, ``fedpose.privacy.engine``); this package keeps its
import light so ``fedpose privacy epsilon`` does not pay for torch.
"""
