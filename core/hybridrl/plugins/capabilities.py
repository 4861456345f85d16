"""Moved to ``hybridrl.engines.capabilities``; this import path stays for one release."""

import sys

from hybridrl.engines import capabilities

sys.modules[__name__] = capabilities
