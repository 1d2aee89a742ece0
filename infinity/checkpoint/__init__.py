"""Checkpoints: sharded save and load of an engine's whole training state, streamed unit by
unit (never the whole model in memory), as safetensors files plus a JSON manifest with
checksums, committed so that a crash never damages an earlier checkpoint (no pickle).

``engine.save_checkpoint(save_dir, tag=None, client_state=None)`` and
``engine.load_checkpoint(load_dir, tag=None, ...)`` keep DeepSpeed's names and return values;
``consolidated_state_dict(checkpoint_dir)`` reads a checkpoint's fp32 weights back as a plain
``state_dict`` (DeepSpeed's ``zero_to_fp32``) without building an engine;
``engine.save_16bit_model(dir)`` writes the weights as ``model.safetensors``.
"""
from infinity.checkpoint.export import consolidated_state_dict, save_model_weights
from infinity.checkpoint.load import load_checkpoint
from infinity.checkpoint.save import save_checkpoint
from infinity.checkpoint.tensor_file import CheckpointError

__all__ = ["CheckpointError", "consolidated_state_dict", "load_checkpoint", "save_checkpoint",
           "save_model_weights"]
