"""The config's `run`, `model` and `data` sections: what a run is called and writes, the model it trains, its data."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import ConfigError, Section, suggest
from tandem.config.trackers import TRACKERS, missing


class RunConfig(Section):
    name: str = Field(
        "run", description="Run name: the trackers' run name (run.report_to; TensorBoard names a run by its folder "
        "instead), kept with the config in each checkpoint's trainer state and model card.",
    )
    project: str = Field(
        "tandem", description="The trackers' project (wandb's project, MLflow's experiment, Trackio's and "
        "SwanLab's project), where runs of one study sit side by side; WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME, "
        "where set, win, as those libraries' users expect.")
    output_dir: str = Field(
        "runs/run", description="Where metrics, the trackers' local stores, plots and checkpoints go."
    )
    seed: int = Field(0, description="Seeds data order, sampling and initialization. Same seed, same metrics (CPU).")
    steps: int = Field(
        100, ge=1, description="GRPO steps to run (one step = one batch of prompts sampled and trained on).",
    )
    threads: int = Field(
        1, ge=0, description="torch threads of this process, the worker's too with the local backend (Ray workers "
        "take placement.cpus_per_worker); 0 = torch's default. One thread is as fast as two for tiny models on a "
        "shared 2-core machine and far steadier.",
    )
    save_every: int = Field(
        50, ge=0, description="Write a checkpoint every N steps (and at the end); 0 = only at the end.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many most recent checkpoints to keep.")
    save_on_signal: bool = Field(
        True, description="On SIGTERM or SIGINT, checkpoint the last completed step before exiting (with code 128 + "
        "the signal's number: 143, 130). On by default: a preempted run then loses no finished step. Off: it exits "
        "without writing one, for models whose checkpoint outlasts the preemption's grace period; a resume then "
        "starts from the last periodic checkpoint.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate on held-out prompts every N steps and after the last one; 0 = only after the "
        "last. A new run also evaluates the model it starts from (step 0); a resumed run does not (its step 0 is in "
        "metrics.jsonl already).",
    )
    report_to: list[str] = Field(
        ["tensorboard"], description="Experiment trackers the run logs to besides metrics.jsonl (always written), "
        "TRL's name and meaning: any of tensorboard, wandb, mlflow, trackio, swanlab, or `none` (or []). Each gets "
        "the resolved config as the run's parameters, every metric at its step, the curves image and the final "
        "evaluation, off the training thread; local by default, under run.output_dir (tensorboard/, wandb/ in "
        "offline mode, mlflow/ as MLflow's SQLite store, trackio/, swanlog/), online where the library's own "
        "variables say (WANDB_MODE, MLFLOW_TRACKING_URI, TRACKIO_DIR, SWANLAB_MODE). A resumed run continues "
        "the same tracker runs (their ids are in output_dir/trackers.json), taking back their values of the steps "
        "it redoes, so that each holds metrics.jsonl's history; where a tracker cannot take them back (wandb, "
        "MLflow outside its SQL stores) or does not resume (SwanLab offline), the resume opens a new tracker run "
        "and gives it metrics.jsonl's history first. One whose library is not installed (for MLflow's local store, "
        "sqlalchemy and alembic too: tandem[mlflow] has them) is refused here with its pip command; one that "
        "fails or hangs (run.tracker_timeout_s) warns once and the run goes on.")
    tracker_timeout_s: float = Field(
        60.0, gt=0.0, description="The longest one call of a tracker may take: its start (its run opened: a "
        "server's first answer, a local store created), then each call after it (a log, the curves, the close). "
        "A tracker still in a call by then is left behind with one warning naming it, where it logs and this "
        "bound, and the run goes on without it (metrics.jsonl holds every metric). A SIGTERM or SIGINT during a "
        "start stops the wait at once. 60 s is far above a start that works (MLflow creating its SQLite store: "
        "~3 s; wandb offline: ~1 s); tests/run/test_trackers.py holds the bound against a loopback server that "
        "accepts and never answers, and a port that refuses.")
    plots: bool = Field(True, description="Write PNG plots of the main curves into output_dir at the end.")
    progress: bool = Field(True, description="Show a progress bar on the console.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> list[str]:
        if value is None:
            value = []
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"run.report_to: {value!r} is not a tracker's name nor a list of them; use e.g. "
                              f"run.report_to=[tensorboard,wandb], or none (metrics.jsonl alone); the trackers: "
                              f"{', '.join(TRACKERS)}")
        if "none" in names and len(set(names)) > 1:
            others = [n for n in names if n != "none"]
            raise ConfigError(f"run.report_to: {list(names)} names none (no tracker) beside {others}; use "
                              f"run.report_to=none alone, or list the trackers without none")
        names = [n for n in names if n != "none"]
        for name in names:
            if name not in TRACKERS:
                raise ConfigError(f"run.report_to: {name!r} is not a tracker tandem logs to (those are "
                                  f"{', '.join(TRACKERS)}; or none){suggest(name, TRACKERS)}")
        absent = missing(names)
        if absent:
            raise ValueError(f"{absent} named but not installed: pip install "
                             f"{' '.join(repr(f'tandem[{n}]') for n in absent)} (or the libraries themselves: "
                             f"pip install {' '.join(absent)}), or leave them out of run.report_to")
        return list(dict.fromkeys(names))


class ModelConfig(Section):
    path: str = Field(
        "", description="A local Hugging Face model folder, a causal LM or a vision-language model (config.json, "
        "safetensors, tokenizer; a processor too for images). "
        "`tandem demo` fills this with its own warm-started model: the tiny dense Qwen2, or the one a preset names "
        "as `demo:<name>` (`demo:qwen3_moe`, examples/moe.yaml); only `tandem demo` reads such a name.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training and sampling dtype. float32 on CPU (no fast bf16 there).",
    )
    trust_remote_code: bool = Field(
        False, description="Run the model folder's own Python code. Off by default: only for folders you trust.",
    )
    freeze_vision: bool = Field(
        True, description="A vision-language model's vision side stays as loaded: the tower and the connector "
        "that projects its features into the language model (everything outside the language model and its head; "
        "ms-swift's freeze_vit and freeze_aligner together) get no gradients and no optimizer state, and the weight "
        "sync sends them once (the first sync into an engine, or every sync into one that drops its weights while "
        "it sleeps), then only the language model's (`sync/bytes` shows it). On by default, as ms-swift's "
        "defaults: a reward over a few thousand steps seldom needs the tower to move, the connector would then "
        "chase features that move under it, and freezing both spares their gradients, their AdamW state (twice "
        "their weights) and their share of every sync. Off: the whole model trains. LoRA adapts the language model "
        "only, so with lora.enabled the vision side never trains either way. A text-only model has no vision side: "
        "the setting changes nothing there.",
    )


class DataConfig(Section):
    task: Literal["arithmetic", "multiply", "long_tail", "colors", "gsm8k", "jsonl"] = Field(
        "arithmetic", description="`arithmetic`: the built-in demo task (generated, no files). `multiply`: 3-4 digit "
        "products, the tool demo's task (examples/tools.yaml: a calculator makes it solvable). `long_tail`: the "
        "arithmetic task's sums, each answer followed by a countdown of long-tailed length, the long-tail demo's "
        "task (examples/long_tail.yaml; reward `long_tail_exact`). `colors`: the vision "
        "demo's task, the colour of a shape in a picture rendered here (examples/vision.yaml). `gsm8k`: the official "
        "GSM8K data in `path` (question / answer after ####): the jsonl files, or `openai/gsm8k` with `subset: main`. "
        "`jsonl`: rows from any source `path` takes, with `prompt_field` and `answer_field`.",
    )
    path: str = Field(
        "", description="Training data (gsm8k and jsonl tasks), one of: a .jsonl or .parquet file; a "
        "`datasets.save_to_disk` folder; a folder `datasets.load_dataset` reads (jsonl/json/parquet/csv files named "
        "by split, such as train.jsonl and test.jsonl or data/train-00000-of-00001.parquet, or a dataset repository "
        "cloned from the Hub, whose README lists its subsets); or a Hugging Face dataset id (`openai/gsm8k`), "
        "downloaded once into the `datasets` cache (HF_DATASETS_CACHE) and read from there offline "
        "(HF_HUB_OFFLINE=1). A path on disk is read first; a missing one of the form namespace/name is a Hub id. "
        "Settings the data lacks (a split, a subset) are refused before any model loads, naming what it has.",
    )
    split: str = Field(
        "train", min_length=1, description="The split of `path` to train on, where it has splits (a Hub id, a "
        "dataset folder, a saved DatasetDict). A file holds one set of rows: anything but `train` is refused there.",
    )
    subset: str = Field(
        "", description="The subset of `path` (the `datasets` configuration name, `load_dataset(path, name)`): "
        "`main` for openai/gsm8k. Empty: the dataset's only or default subset; a dataset with several and no "
        "default is refused, listing them.",
    )
    eval_path: str = Field(
        "", description="Held-out data, in any form `path` takes (for gsm8k: test.jsonl). Empty: the built-in "
        "tasks' (arithmetic, multiply, long_tail) own held-out splits; for a dataset with splits at `path`, its "
        "`eval_split`; "
        "otherwise (a file, or a dataset with no test or validation split) the first eval_size training prompts, "
        "with a warning: scores on them measure memorization as much as skill.",
    )
    eval_split: str = Field(
        "", description="The split to evaluate on: of `eval_path` where it is set, else of `path`. Empty: its "
        "`test` split, else its `validation` split (other than `split`); for an `eval_path` with neither, its only "
        "split. A split named here must exist; a file has none.",
    )
    eval_subset: str = Field(
        "", description="The subset of `eval_path` (empty: its only or default one). Without `eval_path`, the "
        "held-out split is `path`'s, of `subset`.",
    )
    prompt_field: str = Field(
        "question", description="Row field holding the prompt: text, or chat messages (a list of `{role, content}`, "
        "a content being text or a list of `{type: text, text}` and `{type: image}` parts) that are rendered with "
        "the tokenizer's chat template whatever `chat_template` says.",
    )
    image_field: str = Field(
        "images", min_length=1, description="Row field holding the row's images (a list, or one): each a path "
        "(relative to the data file's folder, or to a dataset folder; or absolute), a `data:` URL "
        "(`data:image/png;base64,...`), bytes, a `{bytes, path}` dict (a `datasets` Image feature) or a PIL image, "
        "in a format vLLM reads (PNG, JPEG, WEBP, GIF, BMP, TIFF, ...; not EPS: docs/guides/data.md lists them). "
        "Their number must equal the prompt's placeholders (`<image>` in text, `{type: image}` chat content parts). "
        "Each is read, checked and decoded whole before any model loads (a broken one is refused with its file and "
        "line), and decoded one way for trainer and engines alike (EXIF orientation applied, transparency on "
        "white, 16-bit greyscale as its top 8 bits). A text-only model given rows with images is refused, naming "
        "the first (it would never see them).",
    )
    max_pixels: int = Field(
        12845056, ge=1, description="The most pixels (width x height) an image may have; a row with a bigger one is "
        "refused, naming its size (resize the images, or raise this: tandem does not decode a huge image at every "
        "step to shrink it). With `min_pixels` it also bounds the image processor's resize, one setting for the "
        "trainer's processor and vLLM's (`mm_processor_kwargs`) alike, so that both resize an image the same way: "
        "Qwen2-VL's pixel bounds, or an Idefics3-style longest edge (at most the edge of a square image of this "
        "many pixels, whole tiles where the processor splits images). The bounds only ever tighten the processor's "
        "own (its checkpoint's config); a processor that resizes every image to one size takes none. 12845056 "
        "(16384 x 28 x 28, a 3584 x 3584 image) is Qwen2-VL's processor default: counting and geometry datasets' "
        "images (CLEVR's are 480 x 320) are far below it.",
    )
    min_pixels: int = Field(
        0, ge=0, description="The fewest pixels the image processor resizes an image up to, for it and the engine "
        "alike (as `max_pixels`); a smaller image is not refused. 0: the processor's own default.",
    )
    answer_field: str = Field("answer", description="Row field holding the reference answer.")
    chat_template: bool = Field(
        False, description="Wrap prompts in the tokenizer's chat template (an error if it has none). "
        "Instruct models want it; the demo model has none.",
    )
    system_prompt: str = Field(
        "", description="System message when chat_template is on, or when chat-message prompts have none of their own.",
    )
    max_prompt_tokens: int = Field(
        256, ge=1, description="Prompts longer than this (in tokens, chat template included) are refused with "
        "their row number, or dropped under `overlong_prompts: skip`.",
    )
    overlong_prompts: Literal["error", "skip"] = Field(
        "error", description="A prompt over `max_prompt_tokens`: `error` refuses the run with its line (the default: "
        "dropping rows silently changes the data). `skip` drops it and logs how many were dropped and their lines.",
    )
    eval_size: int = Field(500, ge=1, description="Held-out prompts scored at each evaluation.")

    @model_validator(mode="after")
    def _pixel_range(self) -> "DataConfig":
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels: {self.min_pixels} is above data.max_pixels: {self.max_pixels}; "
                              "lower min_pixels or raise max_pixels")
        return self
