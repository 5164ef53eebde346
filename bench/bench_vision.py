"""Side-by-side GRPO step time of tandem and TRL's GRPOTrainer on one vision-language workload, each phase, tandem/TRL.

    bash scripts/setup.sh bench && .venv/bin/python bench/bench_vision.py [--quick] [--steps N] [--warmup W]
        [--rounds R] [--threads 1]

Builds one tiny Idefics3 here (tandem.demo's vision builders at a larger size: a SigLIP-style tower, pixel shuffle,
a Llama) with its processor, and renders the same pictures for both (tandem.data.colors: PNG files in a temporary
folder, listed in one jsonl file that tandem reads and from which TRL's dataset is made). Then TRL, then tandem, each
in a fresh child process at the same torch thread count, run GRPO on it (`--rounds R`, 3 by default: that pair R
times in turn, TRL, tandem, TRL, ..., so that both see the same stretches of a shared machine's drift): the same
prompts and pictures, G = 8 completions per prompt, the same prompts per step, completions of one fixed length (TRL's
`min_new_tokens` masks EOS, tandem's `rollout.ignore_eos` samples past it), fp32, AdamW at lr 1e-5 on every
parameter (tower included: tandem's `model.freeze_vision` off), KL on for both (0.04, k3, a loaded reference model),
token-mean loss, clip 0.2, tandem's embedded `hf` engine and TRL's own transformers generation, each framework's own
micro-batching at the same token budget. It checks that both ran the same prompt ids and completion lengths and
trained (finite losses, the tower and the language model moved), then prints the step time (median of the measured
steps after the warm-up), each phase, and tandem/TRL as its last line.

The workload has the proportions of geometry and counting tasks with short answers: the prompt (one picture's 64
image tokens and the text around them) is at least twice the completion. tandem's prompt-once layout runs a group's
picture through the tower and its prompt tokens through the language model once per group, in the rollout's
prefill, the reference pass and the update, where TRL runs them once per completion. The ideal ratio printed is that
saving alone at the workload's FLOPs: (prompt + G x completion) / (G x (prompt + completion)), the prompt being the
tower, the connector and the language model over the prompt's tokens. It ignores that the rollout's decode steps (the
same work in both frameworks: small matrix products, a forward's overhead per token) run below the matmul rate,
which moves the measured ratio towards 1.

TRL is a benchmark-only dependency (the `bench` extra); tandem never imports it.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_trl import TrlTimes, matmul_gflops  # noqa: E402  (the TRL timing and the rate measurement, shared)
from tandem.demo import VisionDemoSpec  # noqa: E402  (after the path: the bench runs from a checkout)

G, KL, CLIP, LR, SEED = 8, 0.04, 0.2, 1e-5, 0
LABELS = {"trl": "TRL", "tandem": "tandem"}
# TRL takes conversational prompts only for images; this template renders its messages as tandem's raw prompt
# (`<image>Colour:`), so that both frameworks' processors expand the same text into the same ids (checked)
CHAT_TEMPLATE = ("{% for message in messages %}{% for part in message['content'] %}"
                 "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
                 "{% endfor %}{% endfor %}")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int  # per step; each gets G completions
    new_tokens: int  # every completion's length
    micro_rows: int  # TRL's sequences per forward/backward; tandem gets the same token budget
    model: VisionDemoSpec  # the processor resizes each picture to image_size a side: (image_size / patch_size)^2
    # patches, a quarter of them image tokens after the pixel shuffle

    @property
    def completions(self) -> int:
        return self.prompts * G


WORKLOADS = {
    # 64 image tokens + 5 of text = a 69-token prompt, 32-token completions (2.16x); 12.7 M language-model parameters
    "full": Workload("full", prompts=4, new_tokens=32, micro_rows=16, model=VisionDemoSpec(
        text_hidden_size=512, text_layers=4, text_heads=8, text_kv_heads=4, text_intermediate_size=1536,
        vision_hidden_size=128, vision_layers=2, vision_heads=2, vision_intermediate_size=512, image_size=128,
        patch_size=8)),
    # a smoke test: the same path on a model of a few ms a forward (its times compare nothing)
    "quick": Workload("quick", prompts=1, new_tokens=8, micro_rows=8, model=VisionDemoSpec(
        text_hidden_size=64, text_layers=2, text_heads=2, text_kv_heads=2, text_intermediate_size=128,
        vision_hidden_size=64, vision_layers=1, vision_heads=2, vision_intermediate_size=128, image_size=64,
        patch_size=8)),
}


# ---------------------------------------------------------------------------------------------- the workload


def build(folder: Path, w: Workload, rows: int) -> dict:
    """The model and processor (with CHAT_TEMPLATE) in `folder`, `rows` pictures as PNG files and `rows.jsonl` (tandem's
    data: `<image>Colour:` and the answer); returns the parameter counts and the prompt's tokens."""
    from PIL import Image

    from tandem.data import colors
    from tandem.demo import build_vision_model, build_vision_processor, build_vision_tokenizer

    spec = w.model
    tokenizer = build_vision_tokenizer(spec)
    processor = build_vision_processor(spec, tokenizer)
    processor.chat_template = CHAT_TEMPLATE
    model = build_vision_model(spec, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    picked = colors.rows("train")[:rows]
    lines = []
    for i, row in enumerate(picked):
        (folder / f"picture-{i:03d}.png").write_bytes(row["images"][0])
        lines.append(json.dumps({"question": row["question"], "answer": row["answer"],
                                 "images": [f"picture-{i:03d}.png"]}))
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    picture = Image.open(io.BytesIO(picked[0]["images"][0])).convert("RGB")
    ids = processor(text=[colors.QUESTION], images=[[picture]], return_tensors="pt")["input_ids"][0].tolist()

    def count(prefix: str) -> int:
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))

    embedding = model.get_input_embeddings().weight.numel()
    return {"vision": count("model.vision_model."), "connector": count("model.connector."),
            "text": count("model.text_model.") - embedding + count("lm_head."),
            "prompt_ids": ids, "patches": (spec.image_size // spec.patch_size) ** 2,
            "image_tokens": sum(t == tokenizer.convert_tokens_to_ids("<image>") for t in ids)}


def forward_flops(w: Workload, built: dict) -> tuple[float, float]:
    """FLOPs of one forward over (the prompt: tower with its attention, connector, language model over the prompt's
    tokens; one completion's tokens through the language model). Linear layers 2 per parameter and token; the
    tower's full attention 4 n^2 d per layer; the language model's causal attention is under 2% here, left out."""
    spec, patches = w.model, built["patches"]
    tower = 2 * built["vision"] * patches + spec.vision_layers * 4 * patches ** 2 * spec.vision_hidden_size
    prompt = tower + 2 * built["connector"] * built["image_tokens"] + 2 * built["text"] * len(built["prompt_ids"])
    return prompt, 2 * built["text"] * w.new_tokens


def ideal_ratio(prompt: float, completion: float) -> float:
    """tandem/TRL if running the prompt once per group instead of G times were the only difference: every phase
    (prefill and decode, reference forward, update's forward and backward) scales alike."""
    return (prompt + G * completion) / (G * (prompt + completion))


def letters(completion: str, prompt: str, row, **_) -> float:
    """The bench's reward, one function for both frameworks (tandem's plugin `bench_vision:letters`): the share of
    the colour name's letters found in the completion. The models are random, so exact match would score every
    completion 0 and train nothing; this one spreads within a group."""
    answer = set(str(row["answer"]))
    return len(answer & set(completion)) / len(answer)


letters.inline = True  # cheap and bounded: tandem runs it in the trainer's process, as TRL runs its rewards


VISION_SIDE = ("model.vision_model.", "model.connector.")  # Idefics3's tower and the projection out of it


def weight_change(before: dict, after: dict) -> dict[str, float]:
    """The largest absolute change of any parameter between two {name: tensor} maps, on the vision side (tower and
    connector) and in the language model (with its head): both frameworks must train both."""
    if before.keys() != after.keys():
        raise RuntimeError(f"the weights' names changed in training: {sorted(before.keys() ^ after.keys())[:4]}")
    moved = {"vision": 0.0, "language": 0.0}
    for name in before:
        side = "vision" if name.startswith(VISION_SIDE) else "language"
        moved[side] = max(moved[side], float((after[name].float() - before[name].float()).abs().max()))
    return moved


# ---------------------------------------------------------------------------------------------- TRL child


def run_trl(w: Workload, model: Path, out: Path, steps: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from PIL import Image
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)

    def reward(prompts, completions, answer, **_):
        return [letters(c[-1]["content"], "", {"answer": a}) for c, a in zip(completions, answer)]

    timer, prompt_ids = TrlTimes(), []

    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False, seed=SEED,
        per_device_train_batch_size=w.micro_rows, gradient_accumulation_steps=w.completions // w.micro_rows,
        steps_per_generation=w.completions // w.micro_rows, num_generations=G,
        max_completion_length=w.new_tokens, max_steps=steps, learning_rate=LR, beta=KL, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, num_iterations=1,
        logging_steps=1, report_to=[], save_strategy="no", disable_dropout=True, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": w.new_tokens},
    )
    rows = [json.loads(line) for line in (model / "rows.jsonl").read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"].replace("<image>", "")}],
                             "image": Image.open(model / r["images"][0]).convert("RGB"), "answer": r["answer"]}
                            for r in rows])
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=ds,
                          callbacks=[timer.callback()])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    tokenize = trainer._tokenize_prompts

    def recorded(*a, **k):
        res = tokenize(*a, **k)
        prompt_ids.extend(list(map(int, ids)) for ids in res[0])
        return res

    trainer._tokenize_prompts = recorded
    timer.attach(trainer)
    trainer.train()
    after = {n: p.detach() for n, p in trainer.model.named_parameters()}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"times": timer.times, "tokens": timer.tokens, "phases": timer.phases(), "losses": losses,
            "moved": weight_change(before, after), "prompt_ids": sorted({tuple(ids) for ids in prompt_ids})}


# ---------------------------------------------------------------------------------------------- tandem child


def run_tandem(w: Workload, model: Path, out: Path, steps: int, threads: int) -> dict:
    from safetensors.torch import load_file

    from tandem.architectures import profile
    from tandem.config import load_config
    from tandem.trainer import _prompts, _vision, train

    data = model / "rows.jsonl"
    seq = len(json.loads((model / "built.json").read_text())["prompt_ids"]) + w.new_tokens
    overrides = [
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", f"run.threads={threads}",
        f"run.seed={SEED}", "run.save_every=0", "run.progress=false", "run.report_to=[]", "run.plots=false",
        "data.task=jsonl", f"data.path={data}", f"data.eval_path={data}", "data.eval_size=1",
        f"data.max_prompt_tokens={seq}", f"batch.prompts_per_step={w.prompts}", f"batch.group_size={G}",
        f"batch.micro_batch_tokens={w.micro_rows * seq}", f"rollout.max_new_tokens={w.new_tokens}",
        "rollout.ignore_eos=true", "rollout.engine=hf", f"algo.kl_coef={KL}", "algo.kl_estimator=k3",
        "algo.loss_agg=token_mean", f"algo.clip_low={CLIP}", f"algo.clip_high={CLIP}", "algo.adv_eps=1e-4",
        f"optim.lr={LR}",
        "rewards=[{name: 'bench_vision:letters'}]", "reward_pool.workers=0", "model.dtype=float32",
        "model.freeze_vision=false",  # every parameter trains, as in TRL (checked: `weight_change`)
    ]
    cfg = load_config(None, overrides)
    vision = _vision(cfg, profile(cfg.model.path))
    prompt_ids = sorted({tuple(p.ids) for p in _prompts(cfg, vision)[0]})  # what tandem trains on
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    last = sorted((out / "checkpoints").glob("step-*"))[-1]  # tandem saves after its last step
    return {
        "times": [r["time/step"] for r in rows],
        "tokens": [round(r["completion/length_mean"] * w.completions) for r in rows],
        "phases": [{k[5:]: r[k] for k in ("time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync")}
                   for r in rows],
        "losses": [r["loss"] for r in rows],
        "moved": weight_change(load_file(model / "model.safetensors"), load_file(last / "model.safetensors")),
        "prompt_ids": prompt_ids,
    }


# ---------------------------------------------------------------------------------------------- parent


def child(framework: str, w: Workload, model: Path, work: Path, steps: int, threads: int, round_: int) -> dict:
    """Run one framework in a fresh Python process (no state shared with the other); `round_`: which of the
    bench's rounds (each its own output folder)."""
    result = work / f"{framework}-{w.name}-r{round_}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", framework, "--workload", w.name,
           "--model", str(model), "--out", str(result), "--steps", str(steps), "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"{LABELS[framework]} on the {w.name} workload failed (exit {proc.returncode})")
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke test: a tiny model, 1 warm-up and 1 measured step")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 4; --quick 1)")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    ap.add_argument("--rounds", type=int, default=None,
                    help="each framework's child this many times, in turn (TRL, tandem, TRL, ...), so that both see "
                    "the same stretches of a shared machine's drift; figures are medians over every round's "
                    "measured steps (default 3; --quick 1)")
    ap.add_argument("--child", choices=["trl", "tandem"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if args.child:
        w, model, out = WORKLOADS[args.workload], Path(args.model), Path(args.out)
        run = run_trl if args.child == "trl" else run_tandem
        out.write_text(json.dumps(run(w, model, out.with_suffix(".run"), args.steps, args.threads)))
        return

    import torch

    w = WORKLOADS["quick" if args.quick else "full"]
    steps = args.steps or (1 if args.quick else 4)
    args.rounds = args.rounds or (1 if args.quick else 3)
    total = args.warmup + steps
    print(f"torch {torch.__version__}, threads={args.threads}, cores={os.cpu_count()}, "
          f"load average at start={os.getloadavg()}")
    rates = [matmul_gflops(args.threads)]
    print(f"float32 matmul rate at {args.threads} thread(s): {rates[0]:.1f} GFLOP/s at the start")
    with tempfile.TemporaryDirectory(prefix="tandem-bench-vision-") as tmp:
        work = Path(tmp)
        model = work / "model"
        built = build(model, w, w.prompts * total)
        (model / "built.json").write_text(json.dumps(built))
        rounds: dict[str, list[dict]] = {"trl": [], "tandem": []}
        for round_ in range(args.rounds):
            for fw, done in rounds.items():
                start = time.perf_counter()
                done.append(child(fw, w, model, work, total, args.threads, round_))
                print(f"  {LABELS[fw]:6s} round {round_ + 1}/{args.rounds} done in {time.perf_counter() - start:.0f} "
                      "s, steps: " + ", ".join(f"{t:.3f}" for t in done[-1]["times"])
                      + f"; load {os.getloadavg()[0]:.2f}", flush=True)
            ratio = median_step(rounds["tandem"][-1], args.warmup) / median_step(rounds["trl"][-1], args.warmup)
            print(f"  round {round_ + 1}: tandem/TRL {ratio:.2f}", flush=True)
    rates.append(matmul_gflops(args.threads))
    # the faster of the two: on a shared machine a slow reading is the neighbours' load, and the floor is a bound
    print(f"float32 matmul rate at {args.threads} thread(s): {rates[1]:.1f} GFLOP/s at the end; load average at "
          f"end={os.getloadavg()}")
    report(w, built, rounds, args.warmup, steps, max(rates), args.threads)


def median_step(result: dict, warmup: int) -> float:
    return statistics.median(result["times"][warmup:])


def check(w: Workload, built: dict, res: dict) -> None:
    """Refuse to compare runs that differ: both sides' prompts must be the processor's ids, every completion
    `new_tokens` long, the losses finite, and the vision side and the language model moved on both."""
    want = w.completions * w.new_tokens
    for fw, r in res.items():
        name = LABELS[fw]
        if r["prompt_ids"] != [built["prompt_ids"]]:
            raise SystemExit(f"{name}'s prompt ids differ from the processor's ({r['prompt_ids']} against "
                             f"{built['prompt_ids']}): the frameworks would not run the same prompt")
        if any(n != want for n in r["tokens"]):
            raise SystemExit(f"{name} generated {r['tokens']} completion tokens a step, not {want} "
                             f"({w.completions} x {w.new_tokens}): the completions are not of fixed length")
        if not r["losses"] or not all(map(math.isfinite, r["losses"])) or not min(r["moved"].values()) > 0:
            raise SystemExit(f"{name} did not train the whole model: losses {r['losses']}, largest weight change "
                             f"{r['moved']}")


def report(w: Workload, built: dict, rounds: dict[str, list[dict]], warmup: int, steps: int, rate: float,
           threads: int) -> None:
    """The workload, the evidence that both trained (every round checked; the last round's figures), the table of
    phases (medians over every round's measured steps) and the ratio (the last line)."""
    for i in range(len(rounds["trl"])):
        check(w, built, {fw: done[i] for fw, done in rounds.items()})
    res = {fw: done[-1] for fw, done in rounds.items()}
    plen = len(built["prompt_ids"])
    prompt, completion = forward_flops(w, built)
    step_flops = 5 * G * w.prompts * (prompt + completion)  # TRL's: rollout 1, reference 1, update 3 forwards' worth
    med = {}
    for fw, done in rounds.items():
        measured = [p for r in done for p in r["phases"][warmup:]]
        med[fw] = {"step": statistics.median(t for r in done for t in r["times"][warmup:]),
                   **{k: statistics.median(p[k] for p in measured) for k in measured[0]}}
    print(f"\nworkload {w.name}: {w.prompts} prompts x G={G}, prompt {plen} tokens ({built['image_tokens']} image "
          f"tokens from {built['patches']} patches), completion {w.new_tokens} tokens (prompt/completion "
          f"{plen / w.new_tokens:.2f}); parameters: tower {built['vision'] / 1e6:.2f} M, connector "
          f"{built['connector'] / 1e6:.2f} M, language model {built['text'] / 1e6:.2f} M (embedding left out)")
    print(f"one forward: prompt (tower + connector + prompt tokens) {prompt / 1e9:.3f} GFLOP, completion "
          f"{completion / 1e9:.3f} GFLOP; TRL's step {step_flops / 1e9:.0f} GFLOP, floor "
          f"{step_flops / rate / 1e9:.2f} s at {rate:.1f} GFLOP/s ({threads} thread(s))")
    moved = "; ".join(f"{LABELS[fw]} vision side {r['moved']['vision']:.3g}, language model "
                      f"{r['moved']['language']:.3g}" for fw, r in res.items())
    print(f"trained: losses finite on both (TRL {res['trl']['losses'][-1]:.4g}, tandem "
          f"{res['tandem']['losses'][-1]:.4g} at the last step); largest weight change: {moved}")
    print(f"\nseconds, median of {steps} measured steps after {warmup} warm-up x {len(rounds['trl'])} round(s) (TRL: "
          "rollout = _generate, logprobs = the rest of _generate_and_score_completions, update = the rest of the step)")
    head = f"{'phase':10s} {'tandem s':>9s} {'TRL s':>9s} {'tandem/TRL':>10s}"
    print(head)
    print("-" * len(head))
    for phase in ("rollout", "reward", "logprobs", "update", "sync", "step"):
        t, r = med["tandem"].get(phase), med["trl"].get(phase)
        cells = [f"{x:9.3f}" if x is not None else f"{'-':>9s}" for x in (t, r)]
        ratio = f"{t / r:10.2f}" if t is not None and r is not None and r >= 1e-3 else ""  # not of microseconds
        print(f"{phase:10s} {cells[0]} {cells[1]} {ratio}".rstrip())
    print(f"ideal ratio at these proportions (the prompt once per group instead of G times, FLOPs): "
          f"{ideal_ratio(prompt, completion):.2f}")
    ratio = med["tandem"]["step"] / med["trl"]["step"]
    print(f"ratio tandem/TRL step time: {ratio:.2f} ({'meets' if ratio <= 0.5 else 'misses'} the 0.5 target)")


if __name__ == "__main__":
    main()
