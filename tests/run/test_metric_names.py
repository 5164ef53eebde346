"""The metrics registry (tandem.run.metric_names) against what runs write: every name the demo, the tools demo and the
MoE demo write to metrics.jsonl is in it, and it lists nothing they do not write except what it marks as another
setting's. That mark is kept honest only partly: a demo writing a metric marked as another setting's fails, and a few
of those settings (the one-process ones) are run here; the rest (vLLM, Ray workers, split placement, async, trackers)
are marked from reading the code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.demo import DEMO_DEFAULTS
from tandem.config import load_config
from tandem.run.metric_names import EVERY_RUN, METRICS, PLACEHOLDERS, Metric, entry_of
from tandem.run.metrics import METRICS_FILE, PLOTTED

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMOS = {"demo": None, "tools demo": EXAMPLES / "tools.yaml", "MoE demo": EXAMPLES / "moe.yaml"}
# A few steps, each evaluated; smaller batches than the demo's (a metric's name does not depend on the batch's size).
SHORT = ["run.steps=2", "run.eval_every=1", "run.report_to=none", "run.plots=false", "run.progress=false",
         "data.eval_size=8", "batch.prompts_per_step=4", "batch.group_size=4"]


def untrained(folder: Path, spec, corpus: list[str], tools: bool = False) -> Path:
    """A demo model's architecture and tokenizer as tandem.demo builds them, without the warm start (minutes for the
    tool demo's model): what a run logs depends on the settings and the architecture, not on the weights."""
    from tandem import demo

    tokenizer = demo.build_tokenizer(corpus, spec.vocab_size)
    if tools:
        demo.add_tool_tokens(tokenizer)
    model = spec.build(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from tandem import demo
    from tandem.data import arithmetic, multiply

    root = tmp_path_factory.mktemp("untrained-demo-models")
    return {"tools": untrained(root / "tools", demo.ToolDemoSpec(), multiply.corpus(), tools=True),
            "moe": untrained(root / "moe", demo.MoEDemoSpec(), arithmetic.corpus()),
            "dense": untrained(root / "dense", demo.DemoModelSpec(), arithmetic.corpus())}


def names_written(out: Path) -> set[str]:
    return {k for line in (out / METRICS_FILE).read_text().splitlines() for k in json.loads(line)}


def bound(preset: Path | None, overrides: list[str]) -> dict[str, list[str]]:
    """The values a run's `<reward>` takes: its rewards' names, and `env` with an environment."""
    cfg = load_config(preset, overrides, DEMO_DEFAULTS)
    return {"reward": [r.name for r in cfg.rewards] + ["env"] * bool(cfg.env.name)}


@pytest.fixture(scope="module")
def demos(models, tmp_path_factory) -> dict[str, tuple[set[str], dict]]:
    """Each demo run as `tandem demo [--config preset]` runs it, for a few steps: the names in its metrics.jsonl,
    and its placeholders' values. The demo runs its warm-started model (cached for the test session); the tools
    and MoE demos run untrained models of their architectures in place of theirs."""
    from tandem import demo

    real = demo.demo_model

    def demo_model(spec=None):
        return models["moe"] if isinstance(spec, demo.MoEDemoSpec) else real(*[spec] * (spec is not None))

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "demo_model", demo_model)
        mp.setattr(demo, "tool_demo_model", lambda: models["tools"])
        for name, preset in DEMOS.items():
            run = tmp_path_factory.mktemp(name.replace(" ", "-"))
            overrides = SHORT + [f"run.output_dir={run}"]
            assert main(["demo", *overrides] + ["--config", str(preset)] * bool(preset)) == 0, name
            out[name] = names_written(run), bound(preset, overrides)
    return out


def unlisted(names: set[str], values: dict) -> list[str]:
    return sorted(n for n in names if entry_of(n, values) is None)


def entries(names: set[str], values: dict) -> set[Metric]:
    return {entry_of(n, values) for n in names} - {None}


def test_every_name_a_demo_writes_is_in_the_registry(demos):
    for name, (names, values) in demos.items():
        assert not unlisted(names, values), (
            f"the {name} writes metrics tandem/run/metric_names.py does not list: {unlisted(names, values)}; add "
            f"each with its unit and meaning, then regenerate the reference: .venv/bin/python scripts/gen_docs.py")


def test_the_registry_lists_what_the_demos_write_and_marks_the_rest(demos):
    written = set().union(*(entries(*demo) for demo in demos.values()))
    missing = [m.name for m in METRICS if m.demos and m not in written]
    assert not missing, f"listed as written by the demos, and none does: {missing} (mark demos=False, naming the " \
                        f"setting that writes it, or delete it)"
    wrongly = [m.name for m in METRICS if not m.demos and not m.event and m in written]
    assert not wrongly, f"marked as another setting's (demos=False), yet a demo writes it: {wrongly}"


def test_every_run_writes_what_the_registry_says_every_run_writes(demos):
    for name, (names, values) in demos.items():
        absent = {m.name for m in METRICS if m.written == EVERY_RUN} - {m.name for m in entries(names, values)}
        assert not absent, f"the {name} does not write {sorted(absent)}, listed as written by {EVERY_RUN}"


# Settings the demos lack that run in one process, with the entries marked for them (demos=False) that they write.
SETTINGS = {
    "MoE demo, dynamic sampling, KL, dual clip, TIS, router replay, pass@k": (
        EXAMPLES / "moe.yaml", "moe",
        ["algo.dynamic_sampling=true", "algo.kl_coef=0.01", "algo.dual_clip=3", "algo.tis_cap=2",
         "algo.router_replay=true", "eval.k=2"],
        ["dynamic/kept_group_frac", "dynamic/rounds", "sampled/reward/<reward>", "sampled/reward/<reward>/std",
         "sampled/train/accuracy", "kl", "dual_clip_frac", "tis_capped_frac", "moe/route_mismatch_unreplayed",
         "eval/pass@<k>", "eval/mean@<k>"]),
    "demo, stream, dynamic sampling, masked IS": (
        None, "dense", ["placement.schedule=stream", "algo.dynamic_sampling=true", "algo.is_mask=token"],
        ["async/staleness_mean", "dynamic/kept_group_frac", "dynamic/dropped_groups", "stream/requests_in_flight",
         "stream/tokens_in_flight", "stream/groups_waiting", "stream/restarted", "is_masked_frac"]),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_a_setting_writes_the_metrics_marked_for_it(setting, models, tmp_path):
    """The demo's settings, the preset's, then the setting's, on an untrained model of the preset's architecture."""
    from tandem.trainer import train

    preset, model, overrides, expected = SETTINGS[setting]
    overrides = SHORT + overrides + [f"model.path={models[model]}", f"run.output_dir={tmp_path}"]
    train(load_config(preset, overrides, DEMO_DEFAULTS))
    names, values = names_written(tmp_path), bound(preset, overrides)
    assert not unlisted(names, values), f"not in tandem/run/metric_names.py: {unlisted(names, values)}"
    missing = set(expected) - {m.name for m in entries(names, values)}
    assert not missing, f"{setting}: marked as written by it, not written: {sorted(missing)}"


def test_each_plotted_curve_is_a_listed_metric():
    assert [k for k in PLOTTED if entry_of(k) is None] == []


def test_the_placeholders_name_the_codes_values():
    from tandem.rollout.tools.base import ERRORS
    from tandem.workers.hybrid import PHASES

    for values, placeholder in ((ERRORS, "error"), (PHASES, "phase")):
        assert all(f"`{v}`" in PLACEHOLDERS[placeholder][1] for v in values), placeholder
