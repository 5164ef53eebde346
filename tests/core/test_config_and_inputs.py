"""Bad input is refused early with a message that names what is wrong and how to fix it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.config import ConfigError, load_config
from tandem.data.sources import (GSM8K_INSTRUCTION, DataError, gsm8k_final_answer, load_task_rows, read_rows,
                                 render_prompt)
from tandem.modeling import ModelFolderError, check_model_folder, load_tokenizer


def test_yaml_and_dotted_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("algo:\n  kl_coef: 0.02\nrollout:\n  temperature: 0.9\n")
    cfg = load_config(p, ["algo.kl_coef=0.01", "rollout.stop=['</answer>']", "run.name=x"])
    assert cfg.algo.kl_coef == 0.01 and cfg.rollout.temperature == 0.9
    assert cfg.rollout.stop == ["</answer>"] and cfg.run.name == "x"


def test_unknown_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"algo\.kl_coeff: unknown key; did you mean 'kl_coef'"):
        load_config(None, ["algo.kl_coeff=0.1"])
    p = tmp_path / "run.yaml"
    p.write_text("rolout:\n  temperature: 1.0\n")
    with pytest.raises(ConfigError, match=r"rolout: unknown key; did you mean 'rollout'"):
        load_config(p)
    p.write_text("rollout:\n  decode_kernel: native\n")  # a field since removed (tandem's C decode step), by name
    with pytest.raises(ConfigError, match=r"rollout\.decode_kernel: unknown key"):
        load_config(p)


@pytest.mark.parametrize("override, hint", [
    ("optim.learning_rate=1e-5", r"optim\.learning_rate: unknown key; did you mean 'lr'\? \('learning_rate' in TRL"),
    ("batch.num_generations=4", r"did you mean 'group_size'\? \('num_generations' in TRL\)"),
    ("algo.beta=0.04", r"algo\.beta: unknown key; did you mean 'kl_coef'\? \('beta' in TRL\)"),
    ("algo.epsilon=0.2", r"did you mean 'clip_low'\?"),
    ("optim.epsilon=1e-6", r"did you mean 'eps'\?"),
    ("algo.num_generations=4", r"algo\.num_generations: unknown key; tandem calls it batch\.group_size"),
    ("learning_rate=1e-5", r"learning_rate: unknown key; tandem calls it optim\.lr"),
    ("placement.ulysses_sequence_parallel_size=2",
     r"did you mean 'context_parallel'\? \('ulysses_sequence_parallel_size' in verl\)"),
])
def test_other_frameworks_names_point_to_the_field(override, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(None, [override])


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("batch:\n  group_size: 4\nrun:\n  steps: 3\nbatch:\n  prompts_per_step: 2\n")
    with pytest.raises(ConfigError, match=r"key 'batch' appears twice in one mapping, at lines 1 and 5"):
        load_config(p)
    p.write_text("algo:\n  kl_coef: 0.1\n  mu: 2\n  kl_coef: 0.2\n")
    with pytest.raises(ConfigError, match=r"key 'kl_coef' appears twice in one mapping, at lines 2 and 4"):
        load_config(p)
    # an anchor's keys a merge brings in may be overridden: that is what merges are for
    merged = tmp_path / "merged.yaml"
    merged.write_text("batch:\n  <<: {group_size: 4, prompts_per_step: 8}\n  group_size: 2\n")
    assert load_config(merged).batch.group_size == 2


def test_malformed_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("algo:\n  kl_coef: 0.1\n  mu: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"rollout\.temperature: .*got 'hot'"):
        load_config(None, ["rollout.temperature=hot"])
    with pytest.raises(ConfigError, match=r"batch\.group_size: .*greater than or equal to 1.*got 0"):
        load_config(None, ["batch.group_size=0"])


@pytest.mark.parametrize("overrides, message", [
    (["batch.prompts_per_step=10", "batch.mini_batches=3"], r"batch\.mini_batches: 3 does not divide"),
    (["batch.micro_batch_tokens=100", "data.max_prompt_tokens=64", "rollout.max_new_tokens=64"],
     r"batch\.micro_batch_tokens: 100 cannot hold one sequence .* at least 128"),
    (["batch.group_size=1"], r"batch\.group_size: 1 leaves every GRPO advantage at 0"),
    (["batch.group_size=1", "algo.advantage=reinforce_pp_baseline"], r"batch\.group_size: 1 leaves every GRPO "
     r"advantage at 0 .*or algo\.advantage: reinforce_pp"),
    (["algo.advantage=grpp"], r"algo\.advantage: 'grpp' is not registered; did you mean 'grpo'"),
    (["algo.kl_ratio_correction=true"], r"algo\.kl_ratio_correction: true needs a KL term in the loss .*kl_coef > 0"),
    (["algo.kl_ratio_correction=true", "algo.kl_coef=0.1", "algo.kl_in_reward=true"],
     r"algo\.kl_ratio_correction: true needs a KL term in the loss .*kl_in_reward: false"),
    (["data.task=gsm8k"], r"data\.path: empty"),
    (["placement.workers=2"], r"placement\.workers: 2 needs placement\.backend: ray"),
    (["placement.mode=split"], r"placement\.mode: split needs placement\.backend: ray"),
    (["placement.backend=ray", "placement.workers=3", "placement.tensor_parallel=2"],
     r"placement\.tensor_parallel: 2 does not divide placement\.workers=3"),
    (["placement.schedule=async"], r"placement\.schedule: async needs placement\.mode: split"),
    (["placement.backend=ray", "placement.workers=3", "placement.expert_parallel=2"],
     r"placement\.expert_parallel: 2 does not divide placement\.workers=3"),
    (["placement.backend=ray", "placement.mode=split", "placement.train_workers=2", "placement.expert_parallel=4"],
     r"placement\.expert_parallel: 4 does not divide placement\.train_workers=2"),
    (["placement.backend=ray", "placement.workers=4", "placement.expert_parallel=2", "placement.tensor_parallel=2"],
     r"placement\.expert_parallel: 2 with placement\.tensor_parallel: 2: expert parallelism replaces tensor "
     r"parallelism for the experts"),
    (["placement.backend=ray", "placement.workers=3", "placement.context_parallel=2"],
     r"placement\.context_parallel: 2 x tensor_parallel: 1 does not divide placement\.workers=3"),
    (["placement.backend=ray", "placement.workers=2", "placement.context_parallel=2", "batch.padding_free=false"],
     r"placement\.context_parallel: 2 splits each micro-batch's rows laid end to end; set batch\.padding_free: true"),
    (["placement.backend=ray", "placement.workers=4", "placement.context_parallel=2", "placement.expert_parallel=2"],
     r"placement\.context_parallel: 2 with placement\.expert_parallel: 2"),
    (["placement.backend=ray", "placement.workers=2", "placement.context_parallel=2", "lora.enabled=true"],
     r"placement\.context_parallel: 2 with lora\.enabled"),
])
def test_impossible_arithmetic_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["run.report_to=5"], r"run\.report_to: 5 is not a tracker's name nor a list of them; use e\.g\. "
     r"run\.report_to=\[tensorboard,wandb\], or none"),
    (["run.report_to=[wandb, 3]"], r"run\.report_to: \['wandb', 3\] is not a tracker's name nor a list of them"),
    (["run.report_to=[none, wandb]"], r"run\.report_to: \['none', 'wandb'\] names none \(no tracker\) beside "
     r"\['wandb'\]; use run\.report_to=none alone, or list the trackers without none"),
    (["run.report_to=[tensorbord]"], r"run\.report_to: 'tensorbord' is not a tracker tandem logs to \(those are "
     r"tensorboard, wandb, mlflow, trackio, swanlab; or none\); did you mean 'tensorboard'\?"),
    (["rollout.max_in_flight=8"], r"rollout\.max_in_flight: 8: only placement\.schedule: stream reads it \(its "
     r"requests in flight\), and this run's schedule is sync, where it does nothing; remove it, or set "
     r"placement\.schedule: stream"),
    (["rollout.partial=drop", "rollout.in_flight_weights=false"], r"rollout\.partial: drop, "
     r"rollout\.in_flight_weights: False: only placement\.schedule: stream reads them .* remove them"),
    (["placement.backend=ray", "placement.mode=split", "placement.schedule=async", "rollout.partial=drop"],
     r"rollout\.partial: drop: only placement\.schedule: stream reads it .* this run's schedule is async"),
])
def test_a_setting_that_would_do_nothing_or_names_no_tracker_is_refused(overrides, message):
    """Each was accepted and then did nothing (a tracker list mixing none with trackers, the stream schedule's
    fields under another schedule), or was a TypeError's traceback (run.report_to=5), or named no tracker without
    the nearest one."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    stream = load_config(None, ["placement.schedule=stream", "rollout.max_in_flight=8", "rollout.partial=drop"])
    assert (stream.rollout.max_in_flight, stream.rollout.partial) == (8, "drop")  # where they are read
    # their defaults pass under any schedule: a resolved config (`tandem config`'s) holds every field
    resolved = load_config(None, ["rollout.partial=resume"]).model_dump(mode="json")
    assert load_config(None, [f"rollout.{k}={json.dumps(v)}" for k, v in resolved["rollout"].items()
                              if k in ("max_in_flight", "partial", "in_flight_weights")]).placement.schedule == "sync"


def test_the_stream_schedule_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="stream runs in split placement or in one process"):
        load_config(None, ["placement.schedule=stream", "placement.backend=ray", "placement.mode=colocate"])
    # vLLM streams in process (tests/rollout/test_vllm_engine.py) and as a server (test_vllm_server.py), and
    # conversations stream (tests/workers/test_stream_conversations.py)
    assert load_config(None, ["placement.schedule=stream", "rollout.engine=vllm"]).rollout.vllm.mode == "inprocess"
    assert load_config(None, ["placement.schedule=stream", "rollout.engine=vllm", "rollout.vllm.mode=server"])
    assert load_config(None, ["placement.schedule=stream", "env.name=tools"]).env.name == "tools"


def test_a_report_to_of_the_wrong_type_exits_2_naming_the_field(capsys):
    from tandem.cli import main

    assert main(["config", "run.report_to=5"]) == 2  # was a TypeError traceback, rc 1
    err = capsys.readouterr().err
    assert "run.report_to: 5 is not a tracker's name" in err and "Traceback" not in err, err


def test_router_replay_on_a_dense_model_is_refused_before_models_load(tiny_model, tmp_path, monkeypatch, capsys):
    """The config cannot know the architecture; the model folder's config.json can (tandem.architectures), and is
    read before any model loads. A mixture of experts tandem knows the routers of takes it."""
    from tandem import trainer
    from tandem.run.preflight import check_supported
    from tandem.cli import main

    monkeypatch.setattr(trainer.placement, "build", lambda cfg, model: pytest.fail("models loaded before the refusal"))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny_model}\nrun:\n  output_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(cfg), "algo.router_replay=true"]) == 2
    err = capsys.readouterr().err
    assert ("algo.router_replay: true, but model.path is Qwen2 / Qwen2.5 ('qwen2'), a dense model: it has no routers "
            "tandem can replay (those of Qwen3-MoE, Mixtral, GLM-4.5, ") in err, err
    assert "); set algo.router_replay: false" in err, err
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    check_supported(load_config(None, [f"model.path={moe}", "algo.router_replay=true"]))  # an MoE: accepted


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="is not a folder"):
        check_model_folder(str(tmp_path / "nope"))
    with pytest.raises(ModelFolderError, match="no config.json"):
        check_model_folder(str(tmp_path))
    with pytest.raises(ModelFolderError, match="empty"):
        check_model_folder("")


def test_cli_refuses_before_loading_models(tmp_path):
    """The CLI exits 2 with the message; a missing model is found before anything loads."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path / 'no-model'}\nrun:\n  output_dir: {tmp_path / 'out'}\n")
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "model.path" in r.stderr and "is not a folder" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "train", str(cfg), "algo.kl_cof=1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean 'kl_coef'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_placement_the_devices_cannot_run_is_refused_before_models_load(tiny_model, tmp_path, monkeypatch, capsys):
    """vLLM's own tensor parallel (the local backend) on a machine without the GPUs for it: refused naming the
    fields and the colocated alternative, not a vLLM traceback after the model has loaded."""
    import torch

    from tandem import trainer
    from tandem.cli import main
    from tandem.workers import placement

    def build(cfg, model):
        raise AssertionError("models loaded: the devices should have been refused first")

    monkeypatch.setattr(trainer.placement, "build", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny_model}\nrun:\n  output_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(cfg), "rollout.engine=vllm", "rollout.tensor_parallel=2"]) == 2
    err = capsys.readouterr().err
    assert "rollout.tensor_parallel: 2 with placement.backend: local" in err and "has 0" in err, err
    assert "placement.backend=ray placement.workers=2" in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    placement.check_devices(load_config(None, ["rollout.engine=vllm", "rollout.tensor_parallel=2"]))  # two GPUs: runs


def test_dataset_row_without_field_reports_its_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n\n" + json.dumps({"question": "2+2"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:3 .*missing field 'answer'"):
        read_rows(str(p), "question", "answer")
    p.write_text('{"question": "1+1", "answer": "2"}\n{not json}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        read_rows(str(p), "question", "answer")


def test_empty_dataset(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        read_rows(str(p), "question", "answer")


def test_parquet_and_datasets_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"q": "1+1", "a": "2"}, {"q": "2+3", "a": "5"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for path in (tmp_path / "d.parquet", tmp_path / "folder"):
        rows = load_task_rows("jsonl", str(path), "q", "a", "train")
        assert [(r["question"], r["answer"]) for r in rows] == [("1+1", "2"), ("2+3", "5")]


def test_chat_template_missing_is_refused(tiny_model, chat_model):
    tok = load_tokenizer(tiny_model)
    with pytest.raises(DataError, match="tokenizer has no chat template"):
        render_prompt(tok, "hi", chat_template=True, system_prompt="")
    tok = load_tokenizer(chat_model)
    ids = render_prompt(tok, "1+1=", chat_template=True, system_prompt="be brief")
    assert tok.decode(ids) == "<system>be brief<user>1+1=<assistant>"


def test_gsm8k_official_files(shared_dir):
    gsm = shared_dir / "data" / "gsm8k" / "test.jsonl"
    if not gsm.is_file():
        pytest.skip("shared/data/gsm8k not present")
    rows = load_task_rows("gsm8k", str(gsm), "question", "answer", "train")
    assert len(rows) == 1319
    assert rows[0]["answer"] == "18" and rows[0]["question"].endswith(GSM8K_INSTRUCTION)
    assert gsm8k_final_answer("so 1,234 apples\n#### 1,234") == "1234"
    with pytest.raises(DataError, match="no '####'"):
        gsm8k_final_answer("the answer is 4")


@pytest.mark.parametrize("argv, config, overrides, flags", [
    (["train", "run.yaml", "--resume", "a=b"], "run.yaml", ["a=b"], {"resume": True}),
    (["train", "run.yaml", "a=b", "--resume-or-start", "c=d", "-v"], "run.yaml", ["a=b", "c=d"],
     {"resume_or_start": True, "verbose": True}),
    (["-v", "demo", "a=1", "--config", "examples/dapo.yaml", "b=2"], "examples/dapo.yaml", ["a=1", "b=2"],
     {"verbose": True}),
    (["eval", "run.yaml", "--k", "4", "a=b", "--output", "r.json"], "run.yaml", ["a=b"], {"k": 4, "output": "r.json"}),
])
def test_flags_and_overrides_in_any_order(argv, config, overrides, flags):
    """As people type them: argparse alone ends the overrides at the first flag (`train run.yaml --resume a=b`
    failed with 'unrecognized arguments')."""
    from tandem.cli import build_parser

    args = build_parser().parse_args(argv)
    assert (args.config, args.overrides) == (config, overrides)
    assert {k: getattr(args, k) for k in flags} == flags


def test_the_logprob_guard_follows_the_models_dtype():
    """`max_logprob_diff: auto` is 1e-3 for a float32 model and 5e-2 for bfloat16 or float16 (their measured gaps are
    above 1e-3); a bound given is kept."""
    bound = lambda dtype, *o: load_config(None, list(o)).rollout.logprob_diff_bound(dtype)  # noqa: E731
    assert bound("float32") == 1e-3 and bound("bfloat16") == 5e-2 and bound("float16") == 5e-2
    assert bound("float32", "rollout.engine=vllm") == 1e-3
    assert bound("bfloat16", "rollout.max_logprob_diff=0.5") == 0.5
