"""Moved to ``hybridrl.model.tokenizer``; this import path stays for one release."""

import sys

from hybridrl.model import tokenizer

sys.modules[__name__] = tokenizer
