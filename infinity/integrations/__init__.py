"""Other libraries' training loops on an infinity engine, through their own extension points.

``infinity.integrations.hf``: ``transformers.Trainer`` (and its accelerate) -- change the import
of ``Trainer`` and ``TrainingArguments``. Importing this package imports none of them.
"""
