"""Test-suite setup shared by every directory under tests/.

The tests mirror the package layout (``tests/federation/server/`` tests
``fedpose/federation/server/``, and so on) while their helpers (``site_round_helpers``,
``federation_helpers``, ``numerics``, ``test_dp_engine``'s builders) stay here at the top: pytest's
default import mode puts this conftest's directory on ``sys.path``, so a test in any
subdirectory imports them by name.
"""
