"""hybridrl: RL for LLMs with flexible device mapping.

The core defines roles, placement and the resharding interfaces; training and inference backends are
pluggy plugins found through the ``hybridrl`` entry-point group.
"""

from hybridrl.errors import HybridRLError
from hybridrl.plugins.hookspecs import hookimpl

__all__ = ["HybridRLError", "hookimpl", "__version__"]
__version__ = "0.1.0"
