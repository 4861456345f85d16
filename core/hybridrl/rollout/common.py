"""Moved to ``hybridrl.engines.rollout_kit``; this import path stays for one release."""

import sys

from hybridrl.engines import rollout_kit

sys.modules[__name__] = rollout_kit
