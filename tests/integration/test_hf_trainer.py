"""transformers.Trainer on an infinity engine (infinity.integrations.hf), one rank: the import
changes, nothing else. Against the plain Trainer on the same model and data (gradient
accumulation 2, evaluation every 5 steps, warm-up then linear decay, weight-decay groups, the
default clipping at max_grad_norm 1.0): the same losses, grad norms and learning rates logged;
save_model reloads with transformers to the engine's logits; a run resumed from a Trainer
checkpoint continues the interrupted run's losses."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_common import STEPS, close_rel, hf_args, hf_data, hf_ds, logged
from parity import make_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("infinity.integrations.hf")


def test_the_trainer_trains_logs_saves_and_resumes_as_the_plain_trainer(disk_dir, tmp_path) -> None:
    warnings.filterwarnings("ignore")
    data, evals = hf_data(), hf_data(8, seed=1)
    model = make_model("llama", layers=2, width=32)
    plain = transformers.Trainer(
        model=copy.deepcopy(model), args=transformers.TrainingArguments(tmp_path / "plain",
                                                                        **hf_args()),
        train_dataset=data, eval_dataset=evals)
    plain.train()

    fresh = copy.deepcopy(model)
    trainer = hf.Trainer(
        model=model, train_dataset=data, eval_dataset=evals,
        args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                  **hf_args(save_strategy="steps", save_steps=10)))
    try:
        trainer.train()
        engine = trainer.engine
        assert engine.zero_optimization_stage() == 3 and engine.gradient_accumulation_steps() == 2
        assert engine.gradient_clipping() == 1.0            # "auto" <- max_grad_norm
        # the Trainer's weight-decay groups, taken over: none on biases and norms
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
        close_rel(logged(trainer, "loss"), logged(plain, "loss"), 1e-5)
        close_rel(logged(trainer, "grad_norm"), logged(plain, "grad_norm"), 1e-5)
        assert logged(trainer, "learning_rate") == pytest.approx(logged(plain, "learning_rate"),
                                                                  rel=1e-12)
        evals_ours = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        evals_plain = [h["eval_loss"] for h in plain.state.log_history if "eval_loss" in h]
        close_rel(evals_ours, evals_plain, 1e-5)

        # save_model: a directory transformers loads, holding the engine's current weights
        trainer.save_model(tmp_path / "saved")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        x = torch.stack([d["input_ids"] for d in evals[:4]])
        engine.eval()
        with torch.no_grad():
            ours = engine(input_ids=x).logits
            theirs = reloaded.eval()(input_ids=x).logits
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    finally:
        trainer.close()

    checkpoint = tmp_path / "run" / "checkpoint-10"
    assert (checkpoint / "latest").is_file() and (checkpoint / "model.safetensors").is_file()
    resumed = hf.Trainer(
        model=fresh, train_dataset=data, eval_dataset=evals,
        args=hf.TrainingArguments(tmp_path / "resumed", deepspeed=hf_ds(disk_dir), **hf_args()))
    try:
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert resumed.engine.global_steps == STEPS
        close_rel(logged(resumed, "loss", after=10), logged(trainer, "loss", after=10), 1e-5)
        close_rel(logged(resumed, "grad_norm", after=10), logged(trainer, "grad_norm", after=10),
               1e-5)
    finally:
        resumed.close()


def test_a_config_optimizer_and_schedule_take_the_trainers_values(disk_dir, tmp_path) -> None:
    """An "optimizer" and a "scheduler" section of "auto" values, filled from the arguments as
    Hugging Face fills them; the Trainer's no-decay group keeps weight decay 0. A value written
    that disagrees with the arguments is refused, naming both."""
    warnings.filterwarnings("ignore")
    ds = hf_ds(disk_dir, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
             scheduler={"type": "WarmupDecayLR", "params": {
                 "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                 "total_num_steps": "auto"}})
    trainer = hf.Trainer(model=make_model("llama", layers=1, width=32), train_dataset=hf_data(16),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=ds,
                                                   **hf_args(max_steps=4, eval_strategy="no")))
    try:
        trainer.train()
        groups = trainer.engine.optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert trainer.engine.config.scheduler.total_num_steps == 4
        assert trainer.engine.config.scheduler.warmup_max_lr == 1e-2
        assert all(h["grad_norm"] > 0 for h in trainer.state.log_history if "grad_norm" in h)
        # a second train(): that schedule is spent, and a ds_config's is not rebuilt: refused
        trainer.args.max_steps = 6
        with pytest.raises(ValueError, match="ds_config's \"scheduler\".*spent"):
            trainer.train()
    finally:
        trainer.close()
    wrong = hf_ds(disk_dir, gradient_accumulation_steps=4,
                optimizer={"type": "AdamW", "params": {"lr": 1e-4}})
    trainer = hf.Trainer(model=make_model("llama", layers=1, width=32), train_dataset=hf_data(16),
                         args=hf.TrainingArguments(tmp_path / "wrong", deepspeed=wrong,
                                                   **hf_args(max_steps=4, eval_strategy="no")))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps = 4 but .* = 2\n"
                                         r"- optimizer\.params\.lr = 0\.0001 but .*"
                                         r"learning_rate = 0\.01"):
        trainer.train()


def test_a_second_train_starts_the_schedule_again_as_the_plain_trainer(disk_dir,
                                                                      tmp_path) -> None:
    """trainer.train() again, to train some more: transformers' Trainer makes a new schedule
    for the new steps (the optimizer's state kept); so does infinity's. Before, the engine kept
    the spent schedule: the second run trained at lr 0, its logs looking normal."""
    warnings.filterwarnings("ignore")
    model, data = make_model("llama", layers=1, width=32), hf_data(16)
    plain = transformers.Trainer(model=copy.deepcopy(model), train_dataset=data,
                                 args=transformers.TrainingArguments(
                                     tmp_path / "plain", **hf_args(max_steps=4,
                                                                   eval_strategy="no")))
    ours = hf.Trainer(model=copy.deepcopy(model), train_dataset=data,
                      args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                **hf_args(max_steps=4, eval_strategy="no")))
    try:
        for trainer in (plain, ours):
            trainer.train()
            trainer.args.max_steps = 6
            trainer.train()
        lrs = logged(ours, "learning_rate")
        assert lrs == pytest.approx(logged(plain, "learning_rate"), rel=1e-12)
        assert max(lrs[-3:]) > 0
        close_rel(logged(ours, "loss"), logged(plain, "loss"), 1e-5)
    finally:
        ours.close()


def test_an_engine_from_pretrained_trains_under_the_trainer(disk_dir, tmp_path) -> None:
    """A model too large for host memory comes through infinity.from_pretrained: the Trainer
    trains that engine as it is (its optimizer, the Trainer's schedule), as the plain Trainer
    trains transformers' load of the same directory."""
    import infinity

    warnings.filterwarnings("ignore")
    make_model("llama", layers=2, width=32).save_pretrained(tmp_path / "base")
    data = hf_data(32)
    args = hf_args(max_steps=6, eval_strategy="no", weight_decay=0.0)
    plain = transformers.Trainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
        args=transformers.TrainingArguments(tmp_path / "plain", **args), train_dataset=data)
    plain.train()
    ds = hf_ds(disk_dir, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
               gradient_clipping=1.0)
    engine, *_ = infinity.from_pretrained(
        tmp_path / "base", config=ds,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0))
    trainer = hf.Trainer(model=engine.module, engine=engine, train_dataset=data,
                         args=hf.TrainingArguments(tmp_path / "run", **args))
    try:
        trainer.train()
        close_rel(logged(trainer, "loss"), logged(plain, "loss"), 1e-5)
        close_rel(logged(trainer, "grad_norm"), logged(plain, "grad_norm"), 1e-5)
        assert logged(trainer, "learning_rate") == pytest.approx(logged(plain, "learning_rate"))
    finally:
        trainer.close()
    engine, *_ = infinity.from_pretrained(tmp_path / "base", config=ds,
                                          optimizer=lambda params: torch.optim.AdamW(params))
    try:
        trainer = hf.Trainer(model=engine.module, engine=engine, train_dataset=data,
                             args=hf.TrainingArguments(tmp_path / "bad",
                                                       **{**args, "max_grad_norm": 0.5}))
        with pytest.raises(ValueError, match=r"gradient_clipping = 1\.0 but the Trainer's "
                                             r"max_grad_norm is 0\.5"):
            trainer.train()
        # the optimizer's settings too (learning_rate and weight_decay were ignored)
        trainer = hf.Trainer(model=engine.module, engine=engine, train_dataset=data,
                             args=hf.TrainingArguments(tmp_path / "bad2", **{**args,
                                                       "learning_rate": 5e-5}))
        with pytest.raises(ValueError, match=r"(?s)the optimizer's lr = 0\.001 but the Trainer's "
                                             r"learning_rate is 5e-05.*weight_decay = 0\.01 "
                                             r"but the Trainer's weight_decay is 0\.0"):
            trainer.train()
    finally:
        engine.close()


def test_transformers_own_training_arguments_become_infinitys(disk_dir, tmp_path) -> None:
    """A script that swapped only the Trainer's import: transformers' own TrainingArguments are
    rebuilt as infinity's (a subclass's as both), every field kept, and a ``deepspeed`` value is
    infinity's config (transformers builds one only where the DeepSpeed package is installed:
    here it is set after construction, with the global DeepSpeed config transformers would
    register). Without a config, the error names the import to use; transformers' own
    TrainingArguments(deepspeed=) without DeepSpeed fails in transformers, before infinity sees
    it (the README says so)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    warnings.filterwarnings("ignore")
    args = transformers.TrainingArguments(      # some fields off their defaults, to be kept
        tmp_path / "run", **hf_args(max_steps=2, eval_strategy="no", adam_beta2=0.99,
                                    run_name="own", label_names=["labels"]))
    args.deepspeed = hf_ds(disk_dir)

    class ZeRO3:                       # what transformers registers for a ZeRO-3 deepspeed=
        def is_zero3(self) -> bool:
            return True

    args.hf_deepspeed_config = registered = ZeRO3()
    hf_deepspeed.set_hf_deepspeed_config(registered)
    trainer = hf.Trainer(model=make_model("llama", layers=1, width=32), args=args,
                         train_dataset=hf_data(16))
    try:
        assert isinstance(trainer.args, hf.TrainingArguments) and trainer.args.deepspeed is None
        assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        ours = trainer.args.to_dict()
        assert ours.pop("infinity_config") == args.deepspeed
        assert ours == {**args.to_dict(), "deepspeed": None}
        trainer.train()
        assert trainer.engine.zero_optimization_stage() == 3 and trainer.engine.global_steps == 2
    finally:
        trainer.close()

    seq2seq = hf.as_infinity_args(transformers.Seq2SeqTrainingArguments(
        tmp_path / "s2s", predict_with_generate=True, use_cpu=True, report_to=[]))
    assert isinstance(seq2seq, hf.TrainingArguments)
    assert isinstance(seq2seq, transformers.Seq2SeqTrainingArguments)
    assert seq2seq.predict_with_generate and not seq2seq.place_model_on_device

    plain_args = transformers.TrainingArguments(tmp_path / "none",
                                                **hf_args(max_steps=2, eval_strategy="no"))
    with pytest.raises(ValueError, match="import Trainer and TrainingArguments from "
                                         "infinity.integrations.hf"):
        hf.Trainer(model=make_model("llama", layers=1, width=32), args=plain_args)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        import importlib.metadata

        with pytest.raises(importlib.metadata.PackageNotFoundError, match="deepspeed"):
            transformers.TrainingArguments(tmp_path / "ds", deepspeed=hf_ds(disk_dir))


def test_a_checkpoint_of_weights_alone_is_refused_for_a_resume_saying_why(disk_dir,
                                                                          tmp_path) -> None:
    """A Trainer checkpoint saved with save_only_model=True (or by transformers' own Trainer)
    holds no engine state: a resume from it says so (it said to resume from a checkpoint this
    Trainer saved, which it was); a path that does not exist is named as such."""
    trainer = hf.Trainer(model=make_model("llama", layers=1, width=32), train_dataset=hf_data(4),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                   **hf_args(max_steps=1, eval_strategy="no")))
    weights = tmp_path / "checkpoint-3"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    (weights / "trainer_state.json").write_text("{}")     # its save finished: written last
    with pytest.raises(FileNotFoundError, match="weights but no engine state.*save_only_model"):
        trainer._load_from_checkpoint(str(weights))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer._load_from_checkpoint(str(tmp_path / "nowhere"))


def test_the_best_model_from_checkpoints_of_weights_alone_is_refused_before_training(
        disk_dir, tmp_path) -> None:
    """load_best_model_at_end with save_only_model: the checkpoints hold no engine state, and
    the best one was not loaded (its load found no 'latest' and the engine kept the last step's
    weights, 0.026 from the best's, with a warning only). Refused when the Trainer is made, as
    transformers refuses the pair under DeepSpeed."""
    args = hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir), **hf_args(
        max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        save_only_model=True, load_best_model_at_end=True))
    with pytest.raises(ValueError, match="load_best_model_at_end=True, save_only_model=True.*"
                                         "Drop save_only_model"):
        hf.Trainer(model=make_model("llama", layers=1, width=32), train_dataset=hf_data(4),
                   eval_dataset=hf_data(2), args=args)


@pytest.mark.parametrize("early_step", ["on", "off"])
def test_a_ctrl_c_in_the_trainers_backward_stops_after_its_step(disk_dir, tmp_path,
                                                                early_step: str) -> None:
    """Ctrl-C (a real SIGINT) inside the backward the Trainer runs itself (``loss.backward()``,
    not ``engine.backward``), in a micro-batch whose backward steps units (each under the
    early step; the cycle's last under the deferred one): the micro-batch's backward and step
    finish, then KeyboardInterrupt stops the Trainer, and the engine is at rest after whole
    steps (a checkpoint saves it). Before, the interrupt stopped the backward halfway, some
    units stepped and some not."""
    import os
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    warnings.filterwarnings("ignore")
    model = make_model("llama", layers=2, width=32)
    backwards = {"count": 0}

    def ctrl_c(module, grad_output):
        backwards["count"] += 1
        if backwards["count"] == 4:         # the 4th micro-batch: the 2nd step's last
            os.kill(os.getpid(), signal.SIGINT)
    model.model.layers[1].register_full_backward_pre_hook(ctrl_c)
    ds = hf_ds(disk_dir, infinity={"early_step": early_step})
    if early_step == "on":
        ds["gradient_clipping"] = 0.0
    trainer = hf.Trainer(model=model, train_dataset=hf_data(),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=ds,
                                                   **hf_args(eval_strategy="no",
                                                             max_grad_norm=0.0)))
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        engine = trainer.engine
        assert backwards["count"] == 4 and engine.global_steps == 2
        engine.save_checkpoint(tmp_path / "ckpt")       # at rest: whole steps
    finally:
        trainer.close()


def test_what_the_engine_cannot_honour_from_the_trainer_is_refused_before_it_trains(
        disk_dir, tmp_path) -> None:
    """Each was silent or cryptic: infinity's arguments given to transformers' own Trainer (a
    subclass for a custom loss) trained without infinity, the ds_config ignored; optim="sgd"
    named an initialize(optimizer=...) call the user never made; a metric-driven schedule
    failed at the first step missing its metric (and would never have seen one). Now each is
    refused naming the argument, before any weight moves (stage 3 here)."""
    warnings.filterwarnings("ignore")

    def args(**extra):
        return hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                    **hf_args(max_steps=1, **extra))

    class CustomLoss(transformers.Trainer):
        pass

    with pytest.raises(ValueError, match="given to a Trainer that is not infinity's"):
        CustomLoss(model=make_model("llama", layers=1, width=32), args=args())
    for extra, said in (({"optim": "sgd"}, r"TrainingArguments\(optim='sgd'\) builds a SGD"),
                        ({"lr_scheduler_type": "reduce_lr_on_plateau"},
                         "'reduce_lr_on_plateau'\\) moves the rate from the evaluation's metric")):
        model = make_model("llama", layers=1, width=32)
        trainer = hf.Trainer(model=model, args=args(**extra), train_dataset=hf_data(8),
                             eval_dataset=hf_data(4, seed=1))
        try:
            with pytest.raises(ValueError, match=said):
                trainer.train()
        finally:
            trainer.close()
        assert all(p.numel() > 0 for p in model.parameters()), "the weights moved first"


def test_evaluate_before_train_of_a_zero_init_model_says_how(disk_dir, tmp_path) -> None:
    """The engine is built when training starts; before it, a model built under zero.Init
    has no values, and accelerate's model.to(device) failed on "Cannot copy out of meta
    tensor". Refused, naming eval_on_start and Trainer(engine=...)."""
    import infinity

    warnings.filterwarnings("ignore")
    ds = hf_ds(disk_dir)
    with infinity.zero.Init(config_dict_or_path=ds):
        model = make_model("llama", layers=2, width=32)
    trainer = hf.Trainer(model=model, train_dataset=hf_data(8), eval_dataset=hf_data(4),
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=ds,
                                                   **hf_args(max_steps=2)))
    with pytest.raises(ValueError, match=r"evaluate\(\)/predict\(\) before train\(\) on a model "
                                         r"built under infinity\.zero\.Init.*eval_on_start"):
        trainer.evaluate()
