"""Defaults of ``infinity train`` in one place, importable without torch (the CLI's help reads them)."""
from __future__ import annotations

DEFAULT_PRESET = "85M"
"""The demo model: a byte-level Llama of 85.35M parameters (see infinity.train.models)."""
DEFAULT_STEPS = 60
"""Optimizer steps of the demo."""
DEFAULT_SEQ_LEN = 128
"""Tokens (bytes) per sample."""
DEFAULT_MICRO_BATCH = 2
"""Samples per forward in the demo config."""
DEFAULT_LR = 2e-3
"""Peak learning rate of the demo config."""
DEFAULT_FINETUNE_LR = 1e-4
"""Peak learning rate of the demo config when it fine-tunes a ``--pretrained`` model."""
DEFAULT_WARMUP_STEPS = 10
"""Linear warm-up of the demo config (then cosine decay, WarmupCosineLR)."""
DEFAULT_NVME_PATH = "/var/tmp"
"""Where the engine makes its private swap directory when neither --nvme-path nor the config says."""
DEFAULT_HOST_BUDGET = "512MiB"
"""Host budget of the demo: the 85M model's states (16 B/param = 1.37 GB) are 2.5x this."""
