"""Moved to ``hybridrl.model.tiny``; this import path stays for one release."""

import sys

from hybridrl.model import tiny

sys.modules[__name__] = tiny
