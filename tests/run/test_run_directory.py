"""The run directory: one run at a time, no resume into a typo, metrics and checkpoints that survive damage."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from tandem import trainer
from tandem.run import checkpoint
from tandem.cli import main
from tandem.config import load_config
from tandem.run.metrics import MetricsLog
from tandem.modeling import check_model_files

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "run": {"steps": 2, "save_every": 1, "keep_checkpoints": 2, "progress": False, "report_to": [],
            "plots": False, "seed": 3, "eval_every": 0},
    "batch": {"prompts_per_step": 2, "group_size": 2, "micro_batch_tokens": 64},
    "rollout": {"max_new_tokens": 4}, "data": {"max_prompt_tokens": 8, "eval_size": 4},
    "rewards": [{"name": "arithmetic_exact"}], "reward_pool": {"workers": 0},
}


def config(model: Path, out: Path, *extra: str):
    overrides = [f"{section}.{k}={json.dumps(v)}" for section, kv in SETTINGS.items() if isinstance(kv, dict)
                 for k, v in kv.items()]
    return load_config(None, [*overrides, f"rewards={json.dumps(SETTINGS['rewards'])}", f"model.path={model}",
                              f"run.output_dir={out}", *extra])


def config_file(model: Path, out: Path, folder: Path, **run) -> Path:
    settings = json.loads(json.dumps(SETTINGS))
    settings["model"] = {"path": str(model)}
    settings["run"].update(output_dir=str(out), **run)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if the run gets as far as starting workers (loading models)."""
    def build(cfg, model):
        raise AssertionError("models loaded: the run directory should have been refused first")

    monkeypatch.setattr(trainer.placement, "build", build)


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2, and what was fsynced and renamed while it ran, in order."""
    out = tmp_path_factory.mktemp("finished") / "run"
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *a, **k):
        events.append(("rename", f"{src} -> {dst}"))
        return real_rename(src, dst, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        mp.setattr(os, "rename", rename)
        trainer.train(config(tiny_model, out))
    return out, events


def copy_of(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def run_files(out: Path) -> dict[str, bytes]:
    """Every file of the run in `out` and its bytes, less the lock (which each start rewrites)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "tandem.lock"}


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# -- one run at a time ---------------------------------------------------------------------------------------


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(
        tiny_model, tmp_path, no_models, monkeypatch, caplog, capsys):
    out = tmp_path / "run"
    yml = config_file(tiny_model, out, tmp_path, steps=100000, save_every=0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-m", "tandem.cli", "train", str(yml)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():  # its step-0 evaluation is logged: it is training
            assert holder.poll() is None, "the first run died"
            assert time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        start = time.perf_counter()
        assert main(["train", str(yml)]) == 2
        assert time.perf_counter() - start < 30  # refused before any model loads (no_models)
        err = capsys.readouterr().err
        assert str(out) in err and f"pid {holder.pid}" in err and socket.gethostname() in err, err
        assert "since" in err and "run.output_dir" in err, err
        holder.kill()  # kill -9: no chance to release anything
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
    # the lock is free again (the kernel dropped it); the next run takes over and names the dead holder
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="tandem"):
        run = trainer.start_run(config(tiny_model, out))
    try:
        assert any(f"pid {holder.pid}" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        run.close()
    from tandem.run.directory import RunLock

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem"):
        RunLock.take(out).release()
    assert "taking over" not in caplog.text  # released by close, cleanly: nothing to take over


def test_a_failed_start_releases_the_directory(tiny_model, tmp_path, no_models):
    out = tmp_path / "run"
    for _ in range(2):  # the second attempt is not refused as "in use" by the first
        with pytest.raises(AssertionError, match="models loaded"):
            trainer.start_run(config(tiny_model, out))


# -- what a start may do with what it finds ------------------------------------------------------------------


def test_resume_into_a_directory_without_a_checkpoint_is_refused(tiny_model, tmp_path, no_models, capsys):
    typo = tmp_path / "rnu"
    assert main(["train", str(config_file(tiny_model, typo, tmp_path)), "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(typo) in err and "does not exist" in err and "--resume-or-start" in err, err
    assert not typo.exists()  # a typo does not leave a directory behind
    # a directory a run left without any checkpoint: --resume does not start over it (--resume-or-start does)
    left = tmp_path / "left"
    left.mkdir()
    (left / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["train", str(config_file(tiny_model, left, tmp_path)), "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(left) in err and "metrics.jsonl" in err and "no checkpoint" in err, err
    assert (left / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_resume_or_start_starts_in_a_new_directory(tiny_model, tmp_path):
    out = tmp_path / "new"
    run = trainer.start_run(config(tiny_model, out), "resume_or_start")
    try:
        assert run.start_step == 0 and not run.resumed
    finally:
        run.close()


# What a run killed before its first checkpoint leaves: its metrics, its lock (with the dead holder's details),
# tracker files, and an empty checkpoints folder or one holding a save cut short.
LEFT_WITHOUT_A_CHECKPOINT = {
    "an empty checkpoints folder": ["checkpoints/"],
    "a save cut short": ["checkpoints/step-00000040.tmp/model.safetensors"],
    "no checkpoints folder, a tracker's files": ["tensorboard/events.out", "trackers.json"],
}


def _leave(out: Path, files: list[str]) -> None:
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (out / "tandem.lock").write_text(json.dumps({"pid": 99999999, "host": "gone", "since": "then"}))
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        if not name.endswith("/"):
            (out / name).write_text("x")


@pytest.mark.parametrize("left", sorted(LEFT_WITHOUT_A_CHECKPOINT))
def test_resume_or_start_starts_over_what_a_run_killed_before_its_first_checkpoint_left(tmp_path, caplog, left):
    """A requeued job runs its command again: with no checkpoint to resume, it starts over, saying so, and again at
    the next requeue (not refused forever by the files the killed run left)."""
    from tandem.run.directory import claim

    out = tmp_path / "run"
    _leave(out, LEFT_WITHOUT_A_CHECKPOINT[left])
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="tandem"):
            lock, last = claim(out, "resume_or_start")
        lock.release()
        assert last is None
        assert str(out) in caplog.text and "no checkpoint" in caplog.text and "metrics.jsonl" in caplog.text, \
            caplog.text
        # the new run writes its own; a checkpoints folder stays, emptied (it may be a link to another disk)
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) in (["tandem.lock"],
                                                                           ["checkpoints", "tandem.lock"])
        (out / "metrics.jsonl").write_text('{"step": 0}\n')  # killed again before its first checkpoint
        caplog.clear()


def test_a_requeued_command_with_resume_or_start_goes_on_to_load_the_models(tiny_model, tmp_path, no_models):
    """The command line a requeue runs, twice: each time past the run directory, to the models (no_models)."""
    out = tmp_path / "run"
    _leave(out, ["checkpoints/step-00000040.tmp/model.safetensors"])
    yml = config_file(tiny_model, out, tmp_path)
    for _ in range(2):
        with pytest.raises(AssertionError, match="models loaded"):
            main(["train", str(yml), "--resume-or-start"])
        (out / "metrics.jsonl").write_text('{"step": 0}\n')


FOREIGN = {  # what no run without a checkpoint leaves -> the name the refusal gives
    "a file of the user's": ("notes.txt", "notes.txt"),
    "a checkpoint set aside": ("checkpoints/step-00000002.bad/model.safetensors", "step-00000002.bad"),
    "a step folder without its trainer state": ("checkpoints/step-00000002/model.safetensors", "step-00000002"),
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
def test_resume_or_start_refuses_a_directory_holding_anything_else(tmp_path, foreign):
    from tandem.run.directory import RunDirError, claim

    out = tmp_path / "run"
    path, named = FOREIGN[foreign]
    _leave(out, [path])
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name != "tandem.lock")
    with pytest.raises(RunDirError) as err:
        claim(out, "resume_or_start")
    msg = str(err.value)
    assert str(out) in msg and named in msg and "no checkpoint" in msg, msg
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name != "tandem.lock") == before


def test_resume_or_start_resumes_a_run_with_checkpoints(finished_run, tmp_path):
    from tandem.run.directory import claim

    out = copy_of(finished_run[0], tmp_path)
    before = (out / "metrics.jsonl").read_text()
    lock, last = claim(out, "resume_or_start")
    lock.release()
    assert last == out / "checkpoints" / "step-00000002"
    assert (out / "metrics.jsonl").read_text() == before


def test_a_fresh_start_over_a_run_with_checkpoints_is_refused(finished_run, tmp_path, tiny_model, no_models,
                                                             capsys):
    out = copy_of(finished_run[0], tmp_path)
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", str(config_file(tiny_model, out, tmp_path))]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--resume" in err and "step 2" in err, err
    assert (out / "metrics.jsonl").read_text() == before
    assert [s for s, _ in checkpoint.checkpoints(out / "checkpoints")] == [1, 2]


def test_replace_says_what_it_removes(finished_run, tmp_path, caplog):
    from tandem.run.directory import claim

    out = copy_of(finished_run[0], tmp_path)
    (out / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="tandem"):
        lock, last = claim(out, "replace")
    lock.release()
    assert last is None
    assert "checkpoints" in caplog.text and "metrics.jsonl" in caplog.text and str(out) in caplog.text
    assert sorted(p.name for p in out.iterdir() if p.name != "tandem.lock") == ["notes.txt"]  # not the user's file


# -- metrics.jsonl -------------------------------------------------------------------------------------------


def test_metrics_are_on_disk_before_the_checkpoint_that_covers_them_is_published(finished_run):
    out, events = finished_run
    metrics = str(out / "metrics.jsonl")
    for step in (1, 2):
        publish = next(i for i, (kind, what) in enumerate(events)
                       if kind == "rename" and what.endswith(f"step-{step:08d}"))
        assert any(e == ("fsync", metrics) for e in events[:publish]), f"step {step}: metrics not fsynced first"


def test_a_torn_last_line_is_cut_with_a_warning(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    rows = [json.dumps({"step": s, "loss": 0.5}) for s in range(4)]
    (out / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')  # disk full mid-append
    with caplog.at_level(logging.WARNING, logger="tandem"):
        log = MetricsLog(out, resume_step=3)
    log.close()
    assert [r["step"] for r in log.history] == [0, 1, 2, 3]
    assert metrics_steps(out) == [0, 1, 2, 3]
    assert str(out / "metrics.jsonl") in caplog.text and "line 5" in caplog.text


def test_a_bad_line_in_the_middle_names_the_file_and_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rows = [json.dumps({"step": s}) for s in range(4)]
    rows[2] = rows[2][:5]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=rf"{out / 'metrics.jsonl'}:3"):
        MetricsLog(out, resume_step=3)


def test_resume_with_a_torn_metrics_line_continues(finished_run, tmp_path, tiny_model):
    out = copy_of(finished_run[0], tmp_path)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # a later step's line, torn by a crash
    trainer.train(config(tiny_model, out, "run.steps=3"), resume=True)
    assert metrics_steps(out) == [0, 1, 2, 3]


# -- checkpoints ---------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "trainer_state.json": lambda ck: (ck / "trainer_state.json").write_text('{"step": 2, "da'),
    "rng.pt": lambda ck: (ck / "rng.pt").unlink(),
    "model.safetensors": lambda ck: _truncate(ck / "model.safetensors"),
    "optimizer.pt": lambda ck: _truncate(ck / "optimizer.pt"),
}


@pytest.mark.parametrize("broken", sorted(CORRUPTIONS))
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, tiny_model, caplog,
                                                                    broken):
    out = copy_of(finished_run[0], tmp_path)
    CORRUPTIONS[broken](out / "checkpoints" / "step-00000002")
    with caplog.at_level(logging.WARNING, logger="tandem"):
        run = trainer.start_run(config(tiny_model, out), resume=True)
    run.close()
    assert run.resumed and run.start_step == 1
    assert "step-00000002" in caplog.text and broken in caplog.text, caplog.text
    assert [s for s, _ in checkpoint.checkpoints(out / "checkpoints")] == [1]  # the bad one is set aside
    assert metrics_steps(out) == [0, 1]  # the steps after the checkpoint resumed from are redone


def test_no_valid_checkpoint_lists_what_is_wrong(finished_run, tmp_path, tiny_model, no_models):
    out = copy_of(finished_run[0], tmp_path)
    CORRUPTIONS["rng.pt"](out / "checkpoints" / "step-00000001")
    CORRUPTIONS["model.safetensors"](out / "checkpoints" / "step-00000002")
    with pytest.raises(ValueError) as err:
        trainer.start_run(config(tiny_model, out), resume=True)
    msg = str(err.value)
    assert "step-00000001" in msg and "rng.pt" in msg and "step-00000002" in msg and "model.safetensors" in msg, msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]  # as found


def test_a_failed_checkpoint_write_removes_its_temporary_folder(finished_run, tmp_path):
    root = copy_of(finished_run[0], tmp_path) / "checkpoints"

    def full_disk(folder):
        (Path(folder) / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as err:
        checkpoint.save(root, 3, full_disk, {"step": 3}, keep=2)
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


# -- checksums: damage the header and size checks cannot see -------------------------------------------------


def _flip_safetensors_data_bit(path: Path) -> None:
    """One bit flipped in the middle of the tensor data, past the header: the file keeps its size and header."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len + (len(raw) - 8 - header_len) // 2] ^= 0x04
    path.write_bytes(raw)


def _flip_optimizer_data_bit(path: Path) -> None:
    """One bit flipped inside the largest tensor record of a torch.save zip (torch.load checks no CRC): the zip
    directory at the end, which the size checks read, is untouched."""
    with zipfile.ZipFile(path) as z:
        record = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[record.header_offset + 26: record.header_offset + 30])
    raw[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 0x04
    path.write_bytes(raw)


BIT_FLIPS = {"model.safetensors": _flip_safetensors_data_bit, "optimizer.pt": _flip_optimizer_data_bit}


@pytest.mark.parametrize("broken", sorted(BIT_FLIPS))
def test_a_flipped_bit_in_tensor_data_falls_back_to_the_previous_checkpoint(finished_run, tmp_path, tiny_model,
                                                                            caplog, broken):
    out = copy_of(finished_run[0], tmp_path)
    damaged = out / "checkpoints" / "step-00000002"
    BIT_FLIPS[broken](damaged / broken)
    check_model_files(damaged)  # what the header and size checks see: nothing wrong
    zipfile.ZipFile(damaged / "optimizer.pt").close()
    with caplog.at_level(logging.WARNING, logger="tandem"):
        run = trainer.start_run(config(tiny_model, out, "run.steps=3"), resume=True)
    run.close()
    assert run.resumed and run.start_step == 1
    assert f"{broken}: checksum mismatch" in caplog.text and "step-00000002" in caplog.text, caplog.text
    assert (out / "checkpoints" / "step-00000002.bad").is_dir()
    assert [s for s, _ in checkpoint.checkpoints(out / "checkpoints")] == [1]


def test_a_checkpoint_saved_without_checksums_resumes_with_a_warning(finished_run, tmp_path, tiny_model, caplog):
    """What an older tandem wrote: no checksums.json, nothing in trainer_state.json about one."""
    out = copy_of(finished_run[0], tmp_path)
    for _, folder in checkpoint.checkpoints(out / "checkpoints"):
        (folder / checkpoint.CHECKSUMS).unlink()
        state = json.loads((folder / "trainer_state.json").read_text())
        state.pop("checksums")
        (folder / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="tandem"):
        run = trainer.start_run(config(tiny_model, out, "run.steps=3"), resume=True)
    run.close()
    assert run.start_step == 2
    assert "step-00000002" in caplog.text and "cannot be verified" in caplog.text, caplog.text


def test_every_published_checkpoint_lists_the_checksum_of_each_of_its_files(finished_run):
    out, events = finished_run
    for _step, folder in checkpoint.checkpoints(out / "checkpoints"):
        listed = json.loads((folder / checkpoint.CHECKSUMS).read_text())
        files = sorted(p.name for p in folder.iterdir() if p.name != checkpoint.CHECKSUMS)
        assert sorted(listed["files"]) == files and "model.safetensors" in files and "optimizer.pt" in files
        assert {"rng.pt", "trainer_state.json", "config.json", "tokenizer.json"} <= set(files)
        assert checkpoint.problems(folder) == []
        # written into the temporary folder and on disk before the rename publishes it
        publish = next(i for i, (kind, what) in enumerate(events) if kind == "rename" and what.endswith(folder.name))
        assert ("fsync", f"{folder}.tmp/{checkpoint.CHECKSUMS}") in events[:publish]


def _drop_from_checksums(ck: Path) -> None:
    listed = json.loads((ck / checkpoint.CHECKSUMS).read_text())
    del listed["files"]["optimizer.pt"]
    (ck / checkpoint.CHECKSUMS).write_text(json.dumps(listed))


CHECKSUM_DAMAGE = {  # what is done to a checkpoint -> what problems() must say
    "a listed file deleted": (lambda ck: (ck / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    "a file grown": (lambda ck: (ck / "config.json").write_text((ck / "config.json").read_text() + " "),
                     "config.json: "),
    "a bit flipped in the RNG state": (lambda ck: _flip_optimizer_data_bit(ck / "rng.pt"), "rng.pt: checksum mismatch"),
    "a weights shard added": (lambda ck: shutil.copy(ck / "model.safetensors", ck / "model-extra.safetensors"),
                              "model-extra.safetensors: not in checksums.json"),
    "a file left out of the list": (_drop_from_checksums, "optimizer.pt: not in checksums.json"),
    "checksums.json garbled": (lambda ck: (ck / checkpoint.CHECKSUMS).write_text('{"files": {"rng'),
                               "checksums.json: "),
    "checksums.json deleted": (lambda ck: (ck / checkpoint.CHECKSUMS).unlink(), "checksums.json: missing"),
}


@pytest.mark.parametrize("damage", sorted(CHECKSUM_DAMAGE))
def test_problems_name_the_file_the_checksums_find_wrong(finished_run, tmp_path, damage):
    ck = tmp_path / "step-00000002"
    shutil.copytree(finished_run[0] / "checkpoints" / ck.name, ck)
    (ck / "notes.txt").write_text("a file nothing reads: not damage")
    assert checkpoint.problems(ck) == []
    do, says = CHECKSUM_DAMAGE[damage]
    do(ck)
    found = checkpoint.problems(ck)
    assert any(p.startswith(says) for p in found), found


# -- an unwritable directory ---------------------------------------------------------------------------------


def test_an_output_dir_that_cannot_be_created_is_found_before_models_load(tiny_model, tmp_path, no_models, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "run"
    assert main(["train", str(config_file(tiny_model, out, tmp_path))]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "Not a directory" in err, err


def _read_only(folder: Path) -> list[str] | None:
    """A command prefix under which `folder` is read-only even for root, or None where none can be had here."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        return []
    if not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro '{folder}' '{folder}'"],
                           capture_output=True)
    return None if probe.returncode else ["unshare", "-m", "sh", "-c",
                                          f"mount --bind -o ro '{folder}' '{folder}' && exec \"$@\"", "sh"]


def test_a_read_only_output_dir_is_found_before_models_load(tiny_model, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    yml = config_file(tiny_model, out, tmp_path)
    prefix = _read_only(out)
    if prefix is None:
        pytest.skip("running as root without mount namespaces: no way to make a directory read-only here")
    try:
        r = subprocess.run([*prefix, sys.executable, "-m", "tandem.cli", "train", str(yml)], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        out.chmod(0o700)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(out) in r.stderr and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_a_resume_with_no_steps_left_is_refused_before_models_load(finished_run, tmp_path, tiny_model, no_models,
                                                                   capsys):
    out = copy_of(finished_run[0], tmp_path)  # at step 2
    for steps in (2, 1):
        assert main(["train", str(config_file(tiny_model, out, tmp_path, steps=steps)), "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"run.steps: {steps}, but the run in {out} is at step 2 already" in err and "--model" in err, err
    assert [s for s, _ in checkpoint.checkpoints(out / "checkpoints")] == [1, 2]
    with pytest.raises(AssertionError, match="models loaded"):  # with steps left, it goes on to load them
        trainer.start_run(config(tiny_model, out, "run.steps=3"), resume=True)


def test_a_requeued_finished_run_exits_0_saying_so_before_models_load(finished_run, tmp_path, tiny_model, no_models,
                                                                      capsys):
    """A scheduler requeues a job whose run had finished (its last checkpoint is at run.steps): --resume-or-start
    is the command meant to be repeated, so it succeeds, in one line naming the checkpoint and how to train on."""
    out = copy_of(finished_run[0], tmp_path)  # at step 2, its last
    before = run_files(out)
    yml = config_file(tiny_model, out, tmp_path)
    for _ in range(2):  # again: the first released the directory
        assert main(["train", str(yml), "--resume-or-start"]) == 0
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert len(lines) == 1 and not captured.out, captured
        assert lines[0].startswith(f"tandem: the run in {out} is finished") and "run.steps" in lines[0], lines
        assert str(out / "checkpoints" / "step-00000002") in lines[0], lines
    assert run_files(out) == before  # nothing written, nothing removed
    # a config asking for fewer steps than the run has made is no requeue of it: still refused
    assert main(["train", str(config_file(tiny_model, out, tmp_path, steps=1)), "--resume-or-start"]) == 2
    assert "run.steps: 1, but the run in" in capsys.readouterr().err
