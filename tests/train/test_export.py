"""`tandem export`: an OUT that holds the checkpoint exported, a run or a live run's directory is refused before
anything is written or deleted, `--force` or not; a new folder or a previous export is written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem.cli import main
from tandem.run import checkpoint
from tandem.run.directory import RunLock


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory) -> Path:
    """A LoRA run's directory as a run leaves it, built by hand (no training): its lock (released), its metrics,
    and checkpoints at steps 1 and 2, each a PEFT adapter on tiny_model saved by tandem's checkpoint.save."""
    from peft import LoraConfig, get_peft_model

    from tandem.config import load_config
    from tandem.modeling import load_causal_lm, load_tokenizer

    cfg = load_config(None, [f"model.path={tiny_model}", "lora.enabled=true"]).model_dump(mode="json")
    peft = get_peft_model(load_causal_lm(str(tiny_model)), LoraConfig(r=2, target_modules=["q_proj"]))

    def write_model(folder: str) -> None:
        peft.save_pretrained(folder)
        load_tokenizer(str(tiny_model)).save_pretrained(folder)
        torch.save({}, Path(folder) / "optimizer.pt")

    run = tmp_path_factory.mktemp("lora-run") / "run"
    run.mkdir()
    (run / "tandem.lock").write_text("")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    for step in (1, 2):
        checkpoint.save(run / "checkpoints", step, write_model, {"step": step, "data": {}, "config": cfg},
                        keep=2)
    return run


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def other_run(tmp: Path, source: Path) -> Path:
    """A finished run's directory that does not hold the checkpoint exported."""
    other = tmp / "runs" / "other"
    shutil.copytree(source.parents[1], other)
    return other


# OUT (given the run's directory, the checkpoint exported and tmp_path) -> what the refusal says OUT holds
OUTS = {
    "the checkpoint itself": (lambda run, ck, tmp: ck, "is the checkpoint exported"),
    "the run's directory": (lambda run, ck, tmp: run, "holds the checkpoint exported"),
    "the run's checkpoints folder": (lambda run, ck, tmp: run / "checkpoints", "holds the checkpoint exported"),
    "a folder inside the checkpoint": (lambda run, ck, tmp: ck / "merged", "inside the checkpoint exported"),
    "a symlink to the run's directory": (lambda run, ck, tmp: _link(tmp / "link", run),
                                         "holds the checkpoint exported"),
    "another checkpoint of the run": (lambda run, ck, tmp: run / "checkpoints" / "step-00000001",
                                      "holds a checkpoint"),
    "a folder holding another run": (lambda run, ck, tmp: other_run(tmp, ck).parent, "holds a run's files"),
    "another run's directory": (lambda run, ck, tmp: other_run(tmp, ck), "holds a run's files"),
}


def _link(link: Path, to: Path) -> Path:
    link.symlink_to(to)
    return link


@pytest.mark.parametrize("force", [True, False], ids=["--force", "no-force"])
@pytest.mark.parametrize("case", sorted(OUTS))
def test_an_out_holding_the_checkpoint_or_a_run_is_refused(lora_run, tmp_path, capsys, case, force):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    ck = run / "checkpoints" / "step-00000002"
    where, says = OUTS[case]
    out = where(run, ck, tmp_path)
    before = tree(tmp_path)
    assert main(["export", str(ck), str(out)] + ["--force"] * force) == 2
    err = capsys.readouterr().err
    assert f"export: {out} " in err and says in err and "choose" in err.lower(), err
    assert tree(tmp_path) == before  # nothing written, nothing deleted
    assert not any(p.name.startswith(".") for p in tmp_path.rglob("*"))  # no temporary folder left


def test_a_live_run_s_directory_is_refused_naming_the_holder(lora_run, tmp_path, capsys):
    """A run that has not written a metrics line or a checkpoint yet (loading its models): only its lock says."""
    ck = tmp_path / "run" / "checkpoints" / "step-00000002"
    shutil.copytree(lora_run / "checkpoints" / ck.name, ck)
    live = tmp_path / "live"
    live.mkdir()
    lock = RunLock.take(live)
    try:
        assert main(["export", str(ck), str(live), "--force"]) == 2
        err = capsys.readouterr().err
        assert f"export: {live} " in err and "a run in use" in err and f"pid {lock_pid(live)}" in err, err
        assert sorted(p.name for p in live.iterdir()) == ["tandem.lock"]
    finally:
        lock.release()


def lock_pid(folder: Path) -> int:
    return json.loads((folder / "tandem.lock").read_text())["pid"]


def test_export_writes_a_new_folder_and_replaces_a_previous_export_with_force(lora_run, tmp_path, capsys):
    """Beside the run, and inside the run's directory (a new folder there is no part of the run); --force
    replaces a previous export (a folder that is a model, not a run)."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    ck = run / "checkpoints" / "step-00000002"
    for out in (tmp_path / "merged", run / "merged"):
        assert main(["export", str(ck), str(out)]) == 0, capsys.readouterr().err
        (out / "mine.txt").write_text("old")
        assert main(["export", str(ck), str(out), "--force"]) == 0, capsys.readouterr().err
        assert (out / "model.safetensors").is_file() and not (out / "mine.txt").exists()
    assert checkpoint.problems(ck) == []
