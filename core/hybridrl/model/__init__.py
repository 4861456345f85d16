"""The model as the core sees it, with no backend: its shape (``shape``), the tiny model built from a config
(``tiny``), the tokenizers made in code (``tokenizer``) and the signature a checkpoint is matched by
(``signature``)."""
