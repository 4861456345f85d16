"""Moved to ``hybridrl.engines.batch``; this import path stays for one release."""

import sys

from hybridrl.engines import batch

sys.modules[__name__] = batch
