"""Moved to ``hybridrl.engines.options``; this import path stays for one release."""

import sys

from hybridrl.engines import options

sys.modules[__name__] = options
