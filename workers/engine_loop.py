"""The reference engine's former path: it lives in :mod:`workers.testing.engine` now.

Kept only because ``tests/vllm`` still imports ``ControlPlane`` from here; new code imports
:mod:`workers.testing.engine`.
"""

from workers.testing.engine import *  # noqa: F403
