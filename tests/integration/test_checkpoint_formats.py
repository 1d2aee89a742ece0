"""Checkpoints of Adam states kept in bf16 or int8 (``optimizer_moments``) and of a bf16 master
(``optimizer_master``): the files hold the format (checkpoint/moment_files.py), a checkpoint
resumes bit for bit in its own format and loads into every other one (checkpoint/moment_load.py).

Tolerances of the conversions come from the formats, not from the machine: a value rounded to
nearest bf16 is off by at most 2^-8 of itself (8 significant bits); an int8 value is off by at
most half the widest gap between two neighbouring entries of its map, or the distance from the
map's ends to +-1 (the signed map's lowest entry is -0.993), times its block's absmax: the bound
is computed from the map itself (~0.0070 for m, ~0.0035 for v). Upcasts and dequantization are
exact, so those loads are compared bit for bit.

Also run as a rank worker (``__main__``) by the 2-rank test: argv out_dir nvme_dir ckpt_root.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import infinity
from infinity.checkpoint.directory import resummed
from infinity.checkpoint import CheckpointError, consolidated_state_dict
from infinity.optim.adam_formats import quantization_map
from checkpoint_bytes import content_bytes
from parity import VOCAB, make_model, train_random, train_steps, zero_config

FORMATS = {   # name: (optimizer_moments, optimizer_master)
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "int8": ("int8", "fp32"),
    "int8-bf16-master": ("int8", "bf16"),
}
FIRST, MORE = 2, 2          # steps before the save, and after it
BLOCK = 2048


def _config(nvme_dir, name: str, stage: int = 3, tiers=("nvme", "nvme")) -> dict:
    moments, master = FORMATS[name]
    ds = zero_config(stage, *tiers, str(nvme_dir), compute_dtype="bf16",
                     optimizer_moments=moments, optimizer_master=master)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    return ds


def _engine(nvme_dir, name: str, seed: int = 0, family: str = "llama", **kwargs):
    # every format computes in bf16 (a bf16 master needs it), so that all are comparable
    model = make_model(family, seed=seed, layers=2, width=64)
    engine, *_ = infinity.initialize(model=model, config=_config(nvme_dir, name, **kwargs))
    return engine


def _batches(seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(MORE)]


def _new_disk_dir() -> Path:
    base = os.environ.get("INFINITY_TEST_DISK", "/var/tmp")
    return Path(tempfile.mkdtemp(prefix="infinity-test-formats-", dir=base))


@pytest.fixture(scope="module")
def saved():
    """Each format trained FIRST steps and saved ("<name>/global_step2"), then MORE steps
    (their losses) and saved again ("<name>-end/end"): the run that was not interrupted."""
    root = _new_disk_dir()
    runs = {}
    try:
        for name in FORMATS:
            engine = _engine(root, name)
            try:
                train_random(engine, FIRST)
                path = engine.save_checkpoint(root / name)
                losses = train_steps(engine, _batches())
                end = engine.save_checkpoint(root / f"{name}-end", tag="end")
            finally:
                engine.close()
            runs[name] = (path, losses, end)
        yield root, runs
    finally:
        shutil.rmtree(root, ignore_errors=True)    # our own mkdtemp, never a user path


def _file_bytes(directory: Path) -> dict[str, bytes]:
    """Each tensor file's bytes but its save's id (checkpoint_bytes.py)."""
    return {f: content_bytes(directory / f)
            for f in ("rank0_model.safetensors", "rank0_optim.safetensors")}


def _steps(directory: Path) -> dict:
    return {n: e.get("steps") for n, e in
            json.loads((directory / "manifest.json").read_text())["params"].items()}


@pytest.mark.parametrize("name", ["bf16", "int8", "int8-bf16-master"])
def test_a_checkpoint_resumes_bit_exactly_in_its_own_format(saved, name) -> None:
    """Another init loads the step-2 checkpoint and trains the same 2 steps: the same losses,
    and its states (parameters, master, moments, int8 codes and scales) are the uninterrupted
    run's byte for byte."""
    root, runs = saved
    path, losses, end = runs[name]
    engine = _engine(root, name, seed=7)
    try:
        engine.load_checkpoint(path)
        assert train_steps(engine, _batches()) == losses
        again = engine.save_checkpoint(root / f"{name}-resumed", tag="end")
    finally:
        engine.close()
    assert _file_bytes(again) == _file_bytes(end)
    assert _steps(again) == _steps(end)


def _tensors(directory: Path, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(directory / f"rank0_{kind}.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_the_files_hold_the_format_and_are_smaller(saved) -> None:
    root, runs = saved
    files = {name: {kind: _tensors(runs[name][0], kind) for kind in ("model", "optim")}
             for name in FORMATS}
    sizes = {name: {kind: (runs[name][0] / f"rank0_{kind}.safetensors").stat().st_size
                    for kind in ("model", "optim")} for name in FORMATS}
    moment_dtypes = {name: {t.dtype for k, t in files[name]["optim"][0].items()
                            if not k.endswith(".scales") and "norm" not in k}
                     for name in FORMATS}
    assert moment_dtypes == {"fp32": {torch.float32}, "bf16": {torch.bfloat16},
                             "int8": {torch.uint8}, "int8-bf16-master": {torch.uint8}}
    for name in ("int8", "int8-bf16-master"):
        optim, meta = files[name]["optim"]
        # the final norm's state (64 elements, under 4096) keeps fp32 moments
        assert optim["model.norm.weight.exp_avg"].dtype == torch.float32
        codes = [k for k, t in optim.items() if t.dtype == torch.uint8]
        firsts = json.loads(meta["int8_first"])
        assert meta["int8_block"] == str(BLOCK)
        for k in codes:     # each part with its scales: the blocks its elements touch
            scales = optim[k + ".scales"]
            assert scales.dtype == torch.float32
            assert scales.numel() == (firsts[k + ".scales"] + optim[k].numel() + BLOCK - 1) // BLOCK
    # the fp32 file has what it always had: float32 moments and the format metadata (with its
    # save's id, which version 1 readers ignore)
    assert files["fp32"]["optim"][1].keys() == {"format", "save_id"}
    assert files["fp32"]["optim"][1]["format"] == "infinity-checkpoint"
    # and its manifest is the version every infinity reads; a format's is the one an older
    # infinity refuses as newer instead of reading int8 codes as values
    versions = {name: json.loads((runs[name][0] / "manifest.json").read_text())["version"]
                for name in FORMATS}
    assert versions == {"fp32": 1, "bf16": 2, "int8": 2, "int8-bf16-master": 2}
    assert sizes["bf16"]["optim"] < 0.52 * sizes["fp32"]["optim"]
    assert sizes["int8"]["optim"] < 0.28 * sizes["fp32"]["optim"]
    # a bf16 master is the bf16 parameter, saved as it is: half the model file
    model = files["int8-bf16-master"]["model"][0]
    assert model["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert model["model.norm.weight"].dtype == torch.float32      # its unit keeps fp32
    assert sizes["int8-bf16-master"]["model"] < 0.55 * sizes["int8"]["model"]
    # exports give fp32 master weights as before: the bf16 master upcast, exactly
    state = consolidated_state_dict(runs["int8-bf16-master"][0])
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"],
                       model["model.layers.0.mlp.up_proj.weight"].float())


def _int8_bound(signed: bool) -> float:
    """The largest error of quantizing to the nearest map entry, as a fraction of absmax."""
    q = quantization_map(signed).double()
    half_gap = ((q[1:] - q[:-1]) / 2).max().item()
    ends = max(1 - q.max().item(), (1 + q.min().item()) if signed else 0.0)
    return max(half_gap, ends) * (1 + 1e-5)


def _states(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every tensor of a 1-rank checkpoint as fp32 values (int8 dequantized), with the absmax
    of each element's block for int8 moments."""
    out = {}
    optim, meta = _tensors(directory, "optim")
    firsts = json.loads(meta.get("int8_first", "{}"))
    for k, t in optim.items():
        if k.endswith(".scales"):
            continue
        t = t.reshape(-1)
        if t.dtype == torch.uint8:
            index = (torch.arange(t.numel()) + firsts[k + ".scales"]) // BLOCK
            absmax = optim[k + ".scales"][index]
            out[k] = (quantization_map(not k.endswith("exp_avg_sq"))[t.long()] * absmax, absmax)
        else:
            out[k] = (t.float(), None)
    model, _ = _tensors(directory, "model")
    out.update({k: (t.reshape(-1).float(), None) for k, t in model.items()})
    return out


CONVERSIONS = {
    # (saved, loaded): what the log line says
    ("fp32", "int8"): ["exp_avg fp32 -> int8", "exp_avg_sq fp32 -> int8", "quantized"],
    ("int8", "fp32"): ["moments int8 -> fp32", "exact"],
    ("bf16", "int8"): ["exp_avg bf16 -> int8", "exp_avg_sq bf16 -> int8", "quantized"],
    ("int8-bf16-master", "fp32"): ["moments int8 -> fp32",
                                   "master bf16 -> fp32", "seeded from the bf16 parameters"],
}


@pytest.mark.parametrize("source,target", sorted(CONVERSIONS))
def test_a_checkpoint_loads_into_another_format_within_its_rounding(saved, infinity_info_log,
                                                                    source, target) -> None:
    """A run in ``target`` loads ``source``'s checkpoint and saves at once: its states are the
    saved ones, converted (exact where that is exact, else within the format's rounding of
    the fp32 values), and one log line says what was converted, how much and how far."""
    root, runs = saved
    engine = _engine(root, target, seed=7)
    try:
        infinity_info_log.clear()
        engine.load_checkpoint(runs[source][0])
        lines = [r.getMessage() for r in infinity_info_log.records if "->" in r.getMessage()]
        loaded = engine.save_checkpoint(root / f"{source}-to-{target}")
        assert len(train_steps(engine, _batches())) == MORE        # and it trains on
    finally:
        engine.close()
    assert len(lines) == 1, lines
    for said in CONVERSIONS[source, target]:
        assert said in lines[0], lines[0]
    before, after = _states(runs[source][0]), _states(loaded)
    assert before.keys() == after.keys()
    bound = {True: _int8_bound(True), False: _int8_bound(False)}
    worst = {}
    for k, (x, _) in before.items():
        y, absmax = after[k]
        if absmax is None:          # fp32 (or the bf16 params): exactly the saved values
            assert torch.equal(x, y), k
            continue
        signed = not k.endswith("exp_avg_sq")
        error = ((y - x).abs() / absmax.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
        assert error <= bound[signed], (k, error, bound[signed])
        # the block's absmax is the largest loaded value of the block, not a wider one
        assert torch.all(x.abs() <= absmax), k
        worst[k.rsplit(".", 1)[1]] = max(worst.get(k.rsplit(".", 1)[1], 0.0), error)
    if target == "int8":    # the log's worst error is the one measured here
        for moment, error in worst.items():
            assert f"{moment} {source} -> int8" in lines[0]
            assert f"worst error {error:.2e}" in lines[0], (moment, error, lines[0])


def _damage(path: Path, edit) -> None:
    """Rewrite rank 0's optim file through ``edit(tensors, metadata)`` and its manifest entry
    to match (a damage the checksum does not catch)."""
    target = path / "rank0_optim.safetensors"
    tensors, metadata = _tensors(path, "optim")
    edit(tensors, metadata)
    target.unlink()
    save_file(tensors, str(target), metadata=metadata)
    manifest = json.loads((path / "manifest.json").read_text())
    data = target.read_bytes()
    manifest["files"][target.name] = {"bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(resummed(manifest)))


NAME = "model.layers.0.mlp.up_proj.weight.exp_avg"
DAMAGES = {
    "scales missing": (lambda t, m: t.pop(NAME + ".scales"), "scales tensor .* is missing"),
    "scales of the wrong count": (
        lambda t, m: t.update({NAME + ".scales": t[NAME + ".scales"][:-1]}),
        r"need float32 \[4\]"),
    "codes of the wrong dtype": (lambda t, m: t.update({NAME: t[NAME].view(torch.int8)}),
                                 "is torch.int8: Adam's moments are stored as float32, bfloat16 "
                                 "or uint8"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_int8_part_is_refused_before_anything_loads(saved, damage) -> None:
    root, runs = saved
    path = root / "damaged" / damage.replace(" ", "-")
    shutil.copytree(runs["int8"][0], path)
    edit, message = DAMAGES[damage]
    _damage(path, edit)
    engine = _engine(root, "int8", seed=7)
    try:
        fresh = train_steps(engine, _batches())
        with pytest.raises(CheckpointError, match=message) as refused:
            engine.load_checkpoint(path)
        assert "load_optimizer_states=False" in str(refused.value)
        # refused while checking: the engine's own states are untouched and it trains on
        assert len(train_steps(engine, _batches(seed=6))) == MORE
    finally:
        engine.close()
    assert len(fresh) == MORE


# -- int8 parts on another block grid ----------------------------------------------------------
class _HostStore:
    """A store in host memory, as checkpoint/moment_load.py uses one."""

    resident = True

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel = tensor, tensor.numel()


def test_int8_parts_on_another_grid_are_requantized_and_those_on_the_same_copied_raw(
        tmp_path) -> None:
    """Saved: p began at position 1000 of a block, q at a block edge. Loaded into a state with
    p at 0 and q at 6144 (a block edge): q's blocks are copied raw, p's are requantized on the
    loading grid within the int8 bound, the gap between them holds 0.0. Loaded again with q
    kept (a partial load), q's blocks are left as they are."""
    from infinity.checkpoint.moment_files import SavedMoments
    from infinity.checkpoint.moment_load import Conversions, load_int8
    from infinity.checkpoint.sliced import SlicedReader
    from infinity.checkpoint.tensor_file import TensorFileReader
    from infinity.optim.adam_formats import dequantize_blockwise, quantize_blockwise
    from infinity.zero.unit import ParamEntry

    gen = torch.Generator().manual_seed(0)

    def moment(n: int) -> torch.Tensor:     # values over 4 decades, mixed within blocks
        spread = torch.logspace(-4, 0, n)[torch.randperm(n, generator=gen)]
        return torch.randn(n, generator=gen) * spread

    p, q = moment(6000), moment(4096)
    codes_p, scales_p = quantize_blockwise(torch.cat([torch.zeros(1000), p]), signed=True)
    codes_q, scales_q = quantize_blockwise(q, signed=True)
    path = tmp_path / "rank0_optim.safetensors"
    save_file({"p.exp_avg": codes_p[1000:].reshape(60, 100).contiguous(),
               "p.exp_avg.scales": scales_p, "q.exp_avg": codes_q, "q.exp_avg.scales": scales_q},
              str(path), metadata={"format": "infinity-checkpoint", "int8_block": str(BLOCK),
                                   "int8_first": json.dumps({"p.exp_avg.scales": 1000,
                                                             "q.exp_avg.scales": 0})})
    entries = [ParamEntry("p", None, torch.Size([60, 100]), 0, 6000, 0),
               ParamEntry("q", None, torch.Size([4096]), 6144, 4096, 0)]
    codes = _HostStore(torch.zeros(6144 + 4096, dtype=torch.uint8))
    scales = _HostStore(torch.zeros(5))
    reader = SlicedReader([TensorFileReader(path)], {"p.exp_avg": [60, 100], "q.exp_avg": [4096]},
                          tmp_path, mixed_dtypes=True)
    try:
        saved = SavedMoments(reader, tmp_path)
        saved.check(["p.exp_avg", "q.exp_avg"])
        conversions = Conversions()
        load_int8(codes, scales, 0, entries, [], saved, {e: e.name for e in entries}, ".exp_avg",
                  None, conversions)
        first = codes.tensor.clone(), scales.tensor.clone()
        codes.tensor[6144:] = 0          # q "trained on" since, then p loaded alone
        scales.tensor[3:] *= 2
        kept = codes.tensor.clone(), scales.tensor.clone()
        load_int8(codes, scales, 0, entries[:1], entries[1:], saved, {entries[0]: "p"},
                  ".exp_avg", None, Conversions())
    finally:
        reader.close()
    line = conversions.line()
    assert "exp_avg int8 -> int8 (6000 elements, lossy, requantized on this run's blocks" in line
    assert "as saved, bit-exact: moments int8 (4096 elements)" in line
    assert torch.equal(first[0][6144:], codes_q) and torch.equal(first[1][3:], scales_q)
    saved_p = quantization_map(True)[codes_p[1000:].long()] * \
        scales_p[(torch.arange(6000) + 1000) // BLOCK]
    absmax = first[1].repeat_interleave(BLOCK)[:6000]
    assert ((dequantize_blockwise(first[0], first[1], True)[:6000] - saved_p).abs()
            <= _int8_bound(True) * absmax).all()
    assert torch.equal(first[1][:3], torch.stack([saved_p[i * BLOCK:(i + 1) * BLOCK].abs().max()
                                                  for i in range(3)]))
    assert torch.equal(first[0][6000:6144], torch.full((144,), 127, dtype=torch.uint8))  # 0.0
    # the partial load: p as the first time, q's blocks untouched
    assert torch.equal(codes.tensor[:6144], first[0][:6144])
    assert torch.equal(scales.tensor[:3], first[1][:3])
    assert torch.equal(codes.tensor[6144:], kept[0][6144:])
    assert torch.equal(scales.tensor[3:], kept[1][3:])


# -- saved at 2 ranks, loaded at 1 -----------------------------------------------------------
FAMILY = "torch"     # a plain torch model: the rank processes need not import transformers


def _rank_worker() -> None:
    """One rank of a 2-rank int8 run: FIRST steps on its half of each batch, then save."""
    out, nvme, root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    info = infinity.init_distributed()
    engine = _engine(nvme, "int8", family=FAMILY)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(FIRST):
            batch = torch.randint(0, VOCAB, (2 * info.world_size, 16), generator=gen)
            mine = batch[2 * info.rank:2 * info.rank + 2]
            engine.backward(engine(input_ids=mine, labels=mine))
            engine.step()
        path = engine.save_checkpoint(root)
    finally:
        engine.close()
    (out / f"rank{info.rank}.json").write_text(json.dumps({"path": str(path)}))


@pytest.mark.distributed
def test_an_int8_checkpoint_saved_at_two_ranks_loads_at_one_bit_exactly(saved, infinity_info_log,
                                                                        tmp_path) -> None:
    """Each rank saved its slices with the scales of its own blocks. Shards start on block
    edges (SHARD_ALIGN_NUMEL is the int8 block), so a rank's grid is the whole unit's: the
    1-rank run copies every block raw, and holds the 2-rank run's values bit for bit."""
    from ranks import check_ranks, launch, read_results

    root, _ = saved
    ckpt = root / "two-ranks"
    check_ranks(launch(2, Path(__file__).name, [str(tmp_path), str(root), str(ckpt)],
                       timeout=120))
    path = Path(read_results(tmp_path, 2)[0]["path"])
    optim = {}
    for rank in range(2):
        with safe_open(str(path / f"rank{rank}_optim.safetensors"), "pt") as f:
            firsts = json.loads(f.metadata()["int8_first"])
            optim.update({k: (f.get_tensor(k), firsts.get(k + ".scales")) for k in f.keys()})
    assert any("#" in k and k.endswith(".scales") for k in optim)      # slices with scales
    engine = _engine(root, "int8", seed=7, family=FAMILY)
    try:
        infinity_info_log.clear()
        engine.load_checkpoint(path)
        lines = [r.getMessage() for r in infinity_info_log.records if "bit-exact" in r.getMessage()]
        loaded = engine.save_checkpoint(root / "two-ranks-at-one")
    finally:
        engine.close()
    assert len(lines) == 1 and "as saved, bit-exact: moments int8 (" in lines[0], lines
    assert "->" not in lines[0], lines[0]
    moments = {name: v for name, v in _states(loaded).items() if ".exp_avg" in name}
    assert moments and all(absmax is not None for _, absmax in moments.values())
    for name, (y, absmax) in moments.items():
        parts = sorted((int(k.rpartition("#")[2]), k) for k in optim
                       if k.rpartition("#")[0] == name and not k.endswith(".scales"))
        signed = not name.endswith("exp_avg_sq")
        x, x_absmax = (torch.cat(t) for t in zip(*(_dequantized(optim, k, signed)
                                                   for _, k in parts)))
        assert torch.equal(y, x) and torch.equal(absmax, x_absmax), name


def _dequantized(optim: dict, key: str, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, absmax of each element's block) of one saved int8 part."""
    codes, first = optim[key]
    scales = optim[key + ".scales"][0]
    absmax = scales[(torch.arange(codes.numel()) + first) // BLOCK]
    return quantization_map(signed)[codes.long()] * absmax, absmax


if __name__ == "__main__":
    _rank_worker()
