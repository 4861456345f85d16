"""Moved to ``hybridrl.engines.memory_model``; this import path stays for one release."""

import sys

from hybridrl.engines import memory_model

sys.modules[__name__] = memory_model
