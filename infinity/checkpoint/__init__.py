"""Checkpoints: sharded save and load of a training run's whole state, streamed unit by unit
(never the whole model in memory), as safetensors files plus a JSON manifest with checksums,
committed so that a crash never damages an earlier checkpoint (no pickle).

The engine hands over its parts as a ``TrainingState`` and never itself (DESIGN.md "Layers"):
``engine.save_checkpoint(save_dir, tag=None, client_state=None)`` and
``engine.load_checkpoint(load_dir, tag=None, ...)`` keep DeepSpeed's names and return values
(a load is ``prepare_load`` then ``CheckpointLoad.write``, and the engine applies its
``Restore``); ``consolidated_state_dict(checkpoint_dir)`` reads a checkpoint's fp32 weights
back as a plain ``state_dict`` (DeepSpeed's ``zero_to_fp32``) without building an engine;
``engine.save_16bit_model(dir)`` writes the weights as ``model.safetensors``.
"""
from infinity.checkpoint.export import consolidated_state_dict, save_model_weights
from infinity.checkpoint.load import CheckpointLoad, prepare_load
from infinity.checkpoint.restore import Restore
from infinity.checkpoint.save import save_checkpoint
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.training_state import TrainingState

__all__ = ["CheckpointError", "CheckpointLoad", "Restore", "TrainingState",
           "consolidated_state_dict", "prepare_load", "save_checkpoint", "save_model_weights"]
