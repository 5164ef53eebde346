"""`tandem train | demo | eval | export | config`: the CLI, a thin layer over config loading and the trainer."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from tandem.config import ConfigError, config_reference, load_config
from tandem.run.signals import Stopped
from tandem.workers.group import WorkerError

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, KeyError)


def _train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = _run(cfg, _start(args, "start"))
    if summary is not None:
        print(json.dumps(summary, indent=2))
    return 0


def _run(cfg, start: str) -> dict | None:
    """Train; None where `--resume-or-start` found the run finished already (a requeued job that had ended), said
    in one line: that is a success, so a scheduler does not count the job as failed."""
    from tandem.trainer import RunFinished, train

    try:
        return train(cfg, resume=start)
    except RunFinished as done:
        print(f"tandem: {done}", file=sys.stderr)
        return None


def _start(args, default: str) -> str:
    """What the run does with its directory's previous run (`tandem.run.directory.Start`), from the flags."""
    return "resume" if args.resume else "resume_or_start" if args.resume_or_start else default


def _demo(args) -> int:
    from tandem.demo import DEMO_DEFAULTS

    start = time.perf_counter()
    first = load_config(args.config, args.overrides, DEMO_DEFAULTS)  # refuse bad input before building anything
    reward_paths = _demo_reward_models(first)
    path = _demo_model(first)
    # the demo's model under the preset's (a path given there is trained instead), or in place of its demo:<name>
    named = first.model.path.startswith("demo:")
    teacher = _demo_teacher(first)
    cfg = load_config(args.config, args.overrides + [f"model.path={path}"] * named + teacher,
                      DEMO_DEFAULTS + [f"model.path={path}"] * (not named))
    for i, reward_path in reward_paths.items():
        cfg.rewards[i].path = str(reward_path)
    summary = _run(cfg, _start(args, "replace"))  # the demo is meant to be rerun: it replaces its last run
    if summary is not None:
        summary["wall_seconds_including_bootstrap"] = round(time.perf_counter() - start, 1)
        print(json.dumps(summary, indent=2))
    return 0


def _demo_model(cfg) -> Path:
    """The demo's model for the config: the tool demo's or the long-tail demo's for their tasks (examples/tools.yaml,
    examples/long_tail.yaml), the one `model.path: demo:<name>` names (examples/moe.yaml), else the dense arithmetic
    one."""
    from tandem.demo import DEMO_MODELS, demo_model, long_tail_model, tool_demo_model

    if cfg.data.task == "multiply":
        return tool_demo_model()
    if cfg.data.task == "long_tail":
        return long_tail_model()
    if cfg.model.path.startswith("demo:"):
        name = cfg.model.path.removeprefix("demo:")
        if name not in DEMO_MODELS:
            raise ConfigError(f"model.path: {cfg.model.path!r} names no demo model; the demo builds "
                              f"{', '.join('demo:' + n for n in DEMO_MODELS)} (or leave model.path empty)")
        return demo_model(DEMO_MODELS[name]())
    return demo_model()


def _demo_teacher(cfg) -> list[str]:
    """The override that puts the demo's GRPO-trained model in place of `algo.distill.teacher: demo:grpo`
    (examples/distill.yaml), built on first use; none where the teacher is a folder or unset."""
    from tandem.demo import GRPO_TEACHER, grpo_demo_model

    teacher = cfg.algo.distill.teacher
    if not teacher.startswith("demo:"):
        return []
    if teacher != GRPO_TEACHER:
        raise ConfigError(f"algo.distill.teacher: {teacher!r} names no demo model; the demo's teacher is "
                          f"{GRPO_TEACHER!r} (its own GRPO-trained model), or give a model folder")
    return [f"algo.distill.teacher={grpo_demo_model()}"]


def _demo_reward_models(cfg) -> dict[int, Path]:
    """The demo's models that `rewards[i].path: demo:<name>` names, built (or found cached) by index: its reward
    models (examples/reward_model.yaml) and, for a judge, its GRPO-trained model (examples/judge.yaml); an unknown
    name is refused before anything is built."""
    from tandem.demo import DEMO_REWARD_MODELS, GRPO_TEACHER, grpo_demo_model, reward_model

    named = {i: r.path.removeprefix("demo:") for i, r in enumerate(cfg.rewards) if r.path.startswith("demo:")}
    for i, name in named.items():
        if cfg.rewards[i].name == "judge" and f"demo:{name}" != GRPO_TEACHER:
            raise ConfigError(f"rewards[{i}].path: 'demo:{name}' names no demo judge; the demo's judge is "
                              f"{GRPO_TEACHER!r} (its own GRPO-trained model), or give a model folder")
        if cfg.rewards[i].name != "judge" and name not in DEMO_REWARD_MODELS:
            raise ConfigError(f"rewards[{i}].path: 'demo:{name}' names no demo reward model; the demo builds "
                              f"{', '.join('demo:' + n for n in DEMO_REWARD_MODELS)}")
    return {i: grpo_demo_model() if cfg.rewards[i].name == "judge" else reward_model(DEMO_REWARD_MODELS[name]())
            for i, name in named.items()}


def _optional_config(args) -> None:
    """`tandem eval a.b=1` has no config file: a first positional that looks like an override is one."""
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None


def _eval(args) -> int:
    from tandem.run.evaluation import results, write_json, write_samples
    from tandem.trainer import run_eval, start_run

    _optional_config(args)
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.k:
        overrides.append(f"eval.k={args.k}")
    cfg = load_config(args.config, overrides)
    _refuse_damaged(cfg.model.path, "eval", "evaluate")
    run = start_run(cfg, claim_output_dir=False)  # it writes nothing there, so it never waits on a training run
    try:
        figures = run_eval(run)
    finally:
        run.close()
    print(json.dumps(figures, indent=2))
    if args.output:
        print(f"results: {write_json(args.output, results(run.last_eval, cfg))}", file=sys.stderr)
    if args.samples:
        print(f"samples: {write_samples(args.samples, run.last_eval)}", file=sys.stderr)
    return 0


def _refuse_damaged(path: str, command: str, verb: str) -> None:
    """A checkpoint tandem saved is checked as a resume checks it, every byte against its checksums: a flipped bit
    would otherwise be evaluated or merged into an export silently. A plain model folder has nothing to check."""
    from tandem.run import checkpoint

    damage = checkpoint.damage(Path(path).expanduser()) if path else []
    if damage:
        raise ValueError(f"{command}: checkpoint {path} is damaged: {'; '.join(damage)}; {verb} another one")


def _export(args) -> int:
    from tandem.run.directory import refuse_export_into
    from tandem.run.export import export_merged

    _refuse_damaged(args.checkpoint, "export", "export")
    refuse_export_into(Path(args.checkpoint), Path(args.out))
    print(export_merged(args.checkpoint, args.out, args.base, args.dtype, force=args.force))
    return 0


def _config(args) -> int:
    _optional_config(args)
    if args.doc:
        print(config_reference())
    else:
        cfg = load_config(args.config, args.overrides)
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem",
                                description="GRPO post-training for Hugging Face language and vision-language models.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbose = argparse.ArgumentParser(add_help=False)  # -v after the command too; unset there, the one before holds
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Command)
    sub.add_parser = functools.partial(sub.add_parser, parents=[verbose])  # type: ignore[method-assign]

    t = sub.add_parser("train", help="run GRPO from a YAML config with dotted overrides")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="key=value, e.g. algo.kl_coef=0.01 rollout.temperature=0.8")
    _resume_flags(t, "without either, a new run, refused where run.output_dir holds one with checkpoints")
    t.set_defaults(fn=_train)

    d = sub.add_parser("demo", help="build a tiny warm-started model (cached) and GRPO it on the arithmetic task")
    d.add_argument("overrides", nargs="*", help="key=value overrides of the demo config")
    d.add_argument("--config", help="a preset YAML (e.g. examples/dapo.yaml) layered over the demo's settings")
    _resume_flags(d, "without either, the demo replaces the run in run.output_dir (saying what it removes)")
    d.set_defaults(fn=_demo)

    e = sub.add_parser("eval", help="greedy accuracy and pass@k of a model on the configured task")
    e.add_argument("config", nargs="?", default=None, help="YAML config (default: the built-in arithmetic task)")
    e.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    e.add_argument("--model", help="model folder or checkpoint (sets model.path)")
    e.add_argument("--k", type=int, help="samples per prompt for pass@k (sets eval.k)")
    e.add_argument("--output", help="write the results as JSON here: the figures, per reward and per task, the "
                   "model path and the config (tandem train writes the same into run.output_dir/eval_results.json)")
    e.add_argument("--samples", help="write every prompt's completions and their scores here, one JSON line each")
    e.set_defaults(fn=_eval)

    x = sub.add_parser("export", help="merge a LoRA checkpoint's adapter into its base: a plain Hugging Face folder")
    x.add_argument("checkpoint", help="a checkpoint folder of a lora.enabled run (runs/NAME/checkpoints/step-...)")
    x.add_argument("out", help="the folder to write (transformers and vLLM load it as is)")
    x.add_argument("--base", help="the base model folder, if not where adapter_config.json says (moved since)")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the merged weights")
    x.add_argument("--force", action="store_true", help="replace `out` if it exists (refused otherwise); never "
                   "one that is, holds or is inside a checkpoint, or holds a run or a run's directory in use")
    x.set_defaults(fn=_export)

    c = sub.add_parser("config", help="print the resolved config, or the reference of every field (--doc)")
    c.add_argument("config", nargs="?", default=None, help="YAML config (default: the built-in defaults)")
    c.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    c.add_argument("--doc", action="store_true", help="print every field with its default and meaning (Markdown)")
    c.set_defaults(fn=_config)
    return p


class _Command(argparse.ArgumentParser):
    """A command's parser: flags and positionals (config, overrides) in any order, as people type them
    (`tandem train run.yaml --resume a=b`). Plain argparse ends `overrides` at the first flag."""

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixed:  # argparse's intermixed parsing runs this parser's own passes through here
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False


def _resume_flags(p: argparse.ArgumentParser, otherwise: str) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in run.output_dir; refused where there is none")
    g.add_argument("--resume-or-start", action="store_true",
                   help="resume, or where there is no checkpoint start the run, over what a run stopped before its "
                   "first checkpoint left (metrics, an unfinished save); any other file there is refused; a run "
                   "finished already (at run.steps) exits 0, training nothing. The command for a job that may be "
                   f"requeued; {otherwise}")


def _commands(argv: list[str]) -> tuple[str, str]:
    """This command line as one that resumes the run, and as one that starts it again."""
    again = ["tandem"] + [a for a in argv if a not in ("--resume", "--resume-or-start")]
    return shlex.join(again + ["--resume"]), shlex.join(again)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.fn(args)
    except USER_ERRORS as exc:
        if args.verbose:
            raise
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:  # a worker died or failed: its one-line summary names it; the trace is noise
        if args.verbose:
            raise
        logging.getLogger("tandem").debug("the controller's traceback", exc_info=True)
        resume = f"; what it saved is resumed with: {_commands(argv)[0]}" if args.command in ("train", "demo") else ""
        print(f"tandem: error: {exc}\ntandem: the run stopped{resume} (-v prints the traceback)", file=sys.stderr)
        return 1
    except Stopped as stop:  # SIGTERM or SIGINT during a run: one line, no traceback (tandem.run.signals)
        print(f"tandem: {stop.describe(*_commands(argv))}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a run (checking the config, building the demo's model): no step ran
        print("tandem: interrupted by SIGINT; no training step ran, nothing to save", file=sys.stderr)
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
