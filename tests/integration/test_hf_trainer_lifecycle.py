"""infinity's Trainer over a run's life: train() again with model_init (a fresh model and engine,
as transformers gives hyperparameter_search), resuming after a run killed while it saved a
checkpoint, and TrainingArguments the engine does not apply said so."""
from __future__ import annotations

import logging
import shutil
import warnings

import pytest

from hf_common import hf_args, hf_data, hf_ds, logged
from parity import make_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("infinity.integrations.hf")


def _model():
    return make_model("llama", layers=2, width=32)


def test_train_again_with_model_init_trains_a_fresh_model_as_the_first_run(
        disk_dir, tmp_path) -> None:
    """transformers' second train() calls model_init again and drops the optimizer: the last
    run's engine was handed back (holding the last model) and the run failed on "'NoneType'
    object has no attribute 'step'"."""
    warnings.filterwarnings("ignore")
    trainer = hf.Trainer(model_init=_model, train_dataset=hf_data(16),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                   **hf_args(max_steps=4, eval_strategy="no")))
    try:
        trainer.train()
        first, engine = logged(trainer, "loss"), trainer.engine
        trainer.train()
        assert trainer.engine is not engine and trainer.engine.module is trainer.model
        assert logged(trainer, "loss") == pytest.approx(first, rel=1e-6)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="engine= and model_init="):
        hf.Trainer(model_init=_model, engine=engine,
                   args=hf.TrainingArguments(tmp_path / "x", **hf_args(eval_strategy="no")))


def test_a_checkpoint_whose_save_was_killed_is_skipped_naming_it(
        disk_dir, tmp_path, infinity_log) -> None:
    """A run killed while saving checkpoint-4 (transformers writes trainer_state.json last):
    ``resume_from_checkpoint=True`` took that directory and failed, blaming save_only_model.
    It resumes from checkpoint-2 now, with a warning; the path itself is refused saying the
    save did not finish."""
    warnings.filterwarnings("ignore")

    def trainer(output, steps):
        return hf.Trainer(model=_model(), train_dataset=hf_data(16),
                          args=hf.TrainingArguments(output, deepspeed=hf_ds(disk_dir), **hf_args(
                              max_steps=steps, eval_strategy="no", save_strategy="steps",
                              save_steps=2)))

    first = trainer(tmp_path / "run", 4)
    try:
        first.train()
    finally:
        first.close()
    (tmp_path / "run" / "checkpoint-4" / "trainer_state.json").unlink()     # killed there
    resumed = trainer(tmp_path / "run", 4)
    stepped = _Steps()
    resumed.add_callback(stepped)
    try:
        resumed.train(resume_from_checkpoint=True)
        assert "checkpoint-4 did not finish saving" in infinity_log.text
        assert "resuming from checkpoint-2" in infinity_log.text
        assert stepped.steps == [3, 4] and resumed.engine.global_steps == 4
    finally:
        resumed.close()
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").unlink()
    again = trainer(tmp_path / "run", 4)
    try:
        with pytest.raises(FileNotFoundError, match="its save did not finish"):
            again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
        with pytest.raises(ValueError, match="No valid checkpoint .* checkpoint-2 did not "
                                             "finish saving"):
            again.train(resume_from_checkpoint=True)
    finally:
        again.close()


class _Steps(transformers.TrainerCallback):
    """The optimizer steps a run takes (a resumed one starts after its checkpoint's)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps.append(state.global_step)


def test_torch_compile_is_said_not_to_apply(disk_dir, tmp_path, infinity_log) -> None:
    warnings.filterwarnings("ignore")
    trainer = hf.Trainer(model=_model(), train_dataset=hf_data(8),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                   **hf_args(max_steps=1, eval_strategy="no",
                                                             torch_compile=True)))
    trainer.close()
    assert "torch_compile=True) is not applied" in infinity_log.text


def test_the_newest_finished_checkpoint_is_taken_even_without_engine_state(tmp_path) -> None:
    """A finished save of weights alone (save_only_model) is the newest: it is taken, as
    transformers takes it, and refused saying why (not skipped for an older one, which would
    drop steps, named as a save that did not finish)."""
    from infinity.integrations.hf_resume import check_resumable, last_whole_checkpoint

    for step, files in ((3, ("trainer_state.json", "latest")),
                        (5, ("trainer_state.json", "model.safetensors")),
                        (7, ("model.safetensors",))):          # killed: no trainer_state.json
        directory = tmp_path / f"checkpoint-{step}"
        directory.mkdir()
        for name in files:
            (directory / name).write_text("{}")
    chosen = last_whole_checkpoint(str(tmp_path))
    assert chosen == str(tmp_path / "checkpoint-5")
    with pytest.raises(FileNotFoundError, match="weights but no engine state"):
        check_resumable(chosen)
