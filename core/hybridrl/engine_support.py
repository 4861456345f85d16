"""Moved to ``hybridrl.engines.train_kit``; this import path stays for one release."""

import sys

from hybridrl.engines import train_kit

sys.modules[__name__] = train_kit
