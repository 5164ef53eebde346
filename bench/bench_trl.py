"""Side-by-side GRPO step time of TRL's GRPOTrainer and tandem on identical workloads, against the FLOP floor.

    bash scripts/setup.sh bench && .venv/bin/python bench/bench_trl.py [--workload small|large|both] [--steps N]
        [--warmup W] [--rounds R] [--threads 1] [--engine hf|vllm|both] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--trl-engine hf|vllm]

Builds the models and tokenizer locally (no downloads) into a temporary folder, then for each workload runs TRL,
then tandem, each in a fresh child process (same process tree, same torch thread count); `--rounds R` runs that
pair R times in turn (TRL, tandem, TRL, tandem, ...), so that both see the same stretches of a shared machine's
drift, each round's tandem/TRL printed as it ends, and the figures below pooled over the rounds. It prints one table:
seconds per step (median of the measured steps after warm-up), completion tokens per second, peak RSS, the
workload's FLOPs per step, the FLOP floor (FLOPs / this machine's fp32 matmul rate at the same thread count) and
tandem/TRL. Then each framework's per-phase seconds (TRL's as far as its methods expose them), tandem's weight sync
as a share of its step, and each phase against two references measured in the same run: its floor share (the phase's
FLOPs at the rated matmul rate) and its matrix products alone at the phase's own shapes (a decode step's rows, a
micro-batch's tokens; `achievable_seconds`), which separates a framework's overhead from the machine's rate at that
shape, and where each phase's time goes (matrix products; attention: the rollout's decode attention, the
training phases' causal attention; the rest). The products alone are timed right after each framework's turn, and
that framework's phases are set against them: on a VM whose speed drifts from minute to minute, the reference is
the machine of that minute. `--engine vllm` samples tandem's rollouts with vLLM in its process
(TRL keeps its HF generate); `--engine both` runs tandem with each engine in the same invocation, side by side.

On a GPU (`--device cuda`, written for the day one is lent and not yet run on one: bench/gpu_check.py runs it as its
`trl-vllm` check): `--dtype bfloat16` loads both frameworks' models in bf16 (TRL's `bf16` on too), `--trl-engine
vllm` samples TRL's rollouts with vLLM in its process (its `colocate` mode) as `--engine vllm` does tandem's; the
FLOP floor is then at the GPU's matmul rate in that dtype, and the CPU-only tables (matrix products alone at each
phase's shapes, attention alone) are left out.

Workloads (both: KL 0.04 with the k3 estimator and a loaded reference model, token-mean loss (TRL's `dapo`),
clip 0.2, fp32, no gradient checkpointing, no dropping of zero-variance groups, temperature 1, lr 1e-5):
  small: 4 prompts x 4 generations, 32 new tokens, Qwen2 hidden 256 / 4 layers / 4 heads / 2 KV heads / MLP 512.
  large: 16 prompts x 8 generations, 128 new tokens at fixed length (EOS ignored), Qwen2 hidden 512 / 6 layers /
         8 heads / 4 KV heads / MLP 1536, tied embeddings (19 M parameters).
Prompts are the demo task's questions (`47+38=`, 6 tokens each); the reward is exact match of the answer.

FLOPs per step count 2 P per generated token, 2 P per reference-scored token and 6 P per trained token (P = all
parameters, the tied embedding counted once as the LM head); scored and trained tokens are prompt + completion.
TRL is a benchmark-only dependency (the `bench` extra); tandem never imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    generations: int
    new_tokens: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    ignore_eos: bool
    # TRL's sequences per forward/backward; tandem gets the same token budget (micro_rows x prompt + completion), which
    # its prompt-once layout fills with more rows where prompts are long
    micro_rows: int
    context: int = 0  # tokens of fixed context before every question (a long-prompt workload), 0 = the bare question

    @property
    def completions(self) -> int:
        return self.prompts * self.generations

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


WORKLOADS = {
    "small": Workload("small", 4, 4, 32, 256, 4, 4, 2, 512, ignore_eos=False, micro_rows=16),
    # 32 x 134-token rows per forward/backward: transient activations stay below glibc's 32 MiB mmap threshold
    # and in cache, 1.25x faster per token than one 128-row pass on this machine.
    "large": Workload("large", 16, 8, 128, 512, 6, 8, 4, 1536, ignore_eos=True, micro_rows=32),
}
KL, CLIP, LR, SEED = 0.04, 0.2, 1e-5, 0


def build_model(folder: Path, w: Workload) -> int:
    """A random-initialised Qwen2 of the workload's size with the demo's byte-level BPE; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tandem.data import arithmetic
    from tandem.demo import build_tokenizer

    tok = build_tokenizer(arithmetic.corpus(), 300)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads, intermediate_size=w.mlp, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def matmul_gflops(threads: int, device: str = "cpu", dtype: str = "float32", seconds: float = 2.0) -> float:
    """This machine's matmul rate in `dtype` at `threads` torch threads (CPU) or on the first GPU, on a
    training-sized GEMM (4096 x 512 x 1536)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(4096, 512, device=device, dtype=dt), torch.randn(512, 1536, device=device, dtype=dt)
    out = torch.empty(4096, 1536, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b, out=out)
    sync()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1 if device == "cpu" else 50):  # a GPU's GEMM takes microseconds: time batches of them
            torch.mm(a, b, out=out)
            n += 1
        sync()
    return 2 * 4096 * 512 * 1536 * n / (time.perf_counter() - start) / 1e9


def phase_flops(w: Workload, params: int, prompt_tokens: int) -> dict[str, float]:
    """FLOPs of each phase of a step: 2 P per generated token, 2 P per reference-scored token, 6 P per trained one."""
    seq = w.completions * (prompt_tokens + w.new_tokens)
    return {"rollout": 2 * params * w.completions * w.new_tokens, "logprobs": 2 * params * seq,
            "update": 6 * params * seq}


def linear_shapes(w: Workload, vocab: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's matrix products, as the HF model defines them, then the LM head's."""
    head_dim = w.hidden // w.heads
    q, kv = w.heads * head_dim, w.kv_heads * head_dim
    layer = [(w.hidden, q), (w.hidden, kv), (w.hidden, kv), (q, w.hidden), (w.hidden, w.mlp), (w.hidden, w.mlp),
             (w.mlp, w.hidden)]
    return layer + [(w.hidden, vocab)]


def gemm_seconds(shapes: list[tuple[int, int]], rows: int, backward: bool, repeats: int = 5) -> float:
    """Best time (of `repeats` runs after a warm-up one) of the matrix products of `shapes` on `rows` rows (forward
    x W^T; with `backward` also dY W and dY^T x), each shape with its own weight, run in turn as a model's layers
    are: a decode step's few rows read every layer's weights from memory, which a benchmark on one hot weight would
    hide."""
    import torch

    weights = [torch.randn(n_out, n_in) for n_in, n_out in shapes]
    xs = {n: torch.randn(rows, n) for n in {d for shape in shapes for d in shape}}

    def once() -> float:
        start = time.perf_counter()
        for wt in weights:
            n_out, n_in = wt.shape
            torch.nn.functional.linear(xs[n_in], wt)
            if backward:
                torch.mm(xs[n_out], wt)
                torch.mm(xs[n_out].t(), xs[n_in])
        return time.perf_counter() - start

    once()
    return min(once() for _ in range(repeats))


def decode_attention_seconds(w: Workload, prompt_tokens: int) -> float:
    """A rollout's attention alone: every decode step's one query per row and head against the row's keys so far
    on per-row float32 caches (as HF generate and tandem's engine run it), each layer on its own cache
    (as a model holds them: one cache for every layer would be read from the processor's cache where a model's are
    read from memory), by PyTorch's SDPA. Not in the FLOP floor (a few % of the FLOPs), but a matrix-vector product
    per row and KV head, which runs far below the matmul rate: this is how much of a rollout that costs on this
    machine."""
    import torch
    import torch.nn.functional as F

    head_dim, rows, dt = w.hidden // w.heads, w.completions, torch.float32
    shape = (rows, w.kv_heads, prompt_tokens + w.new_tokens, head_dim)
    caches = [(torch.randn(shape, dtype=dt), torch.randn(shape, dtype=dt)) for _ in range(w.layers)]
    q = torch.randn(rows, w.heads, 1, head_dim, dtype=dt)

    def attend(k: torch.Tensor, v: torch.Tensor, c: int):
        F.scaled_dot_product_attention(q, k[:, :, :c], v[:, :, :c], enable_gqa=w.heads != w.kv_heads)
    attend(*caches[0], prompt_tokens + 1)  # first-call setup, not timed
    start = time.perf_counter()
    for c in range(prompt_tokens + 1, prompt_tokens + w.new_tokens + 1):
        for k, v in caches:
            attend(k, v, c)
    return time.perf_counter() - start


def training_attention_seconds(w: Workload, prompt_tokens: int, repeats: int = 3) -> dict[str, float]:
    """The training phases' attention alone: causal SDPA on one micro-batch of `micro_rows` full sequences (the
    kernel the HF forward calls on rows without padding), forward (logprobs) and forward and backward (update),
    scaled to the layers and micro-batches. Like the decode attention, it is in neither the FLOP floor nor the
    GEMMs: this is how much of a training phase beyond its products the attention alone explains."""
    import torch
    import torch.nn.functional as F

    seq, head_dim = prompt_tokens + w.new_tokens, w.hidden // w.heads
    q = torch.randn(w.micro_rows, w.heads, seq, head_dim, requires_grad=True)
    k = torch.randn(w.micro_rows, w.kv_heads, seq, head_dim, requires_grad=True)
    v = torch.randn(w.micro_rows, w.kv_heads, seq, head_dim, requires_grad=True)
    grad = torch.ones(w.micro_rows, w.heads, seq, head_dim)

    def once(backward: bool) -> float:
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=w.heads != w.kv_heads)
            if backward:
                o.backward(grad)
        return time.perf_counter() - start

    per_pass = w.layers * w.completions / w.micro_rows
    once(True)
    return {"logprobs": per_pass * min(once(False) for _ in range(repeats)),
            "update": per_pass * min(once(True) for _ in range(repeats))}


def achievable_seconds(w: Workload, vocab: int, prompt_tokens: int) -> dict[str, float]:
    """Each phase's matrix products alone, at the shapes the phase runs them: the machine's rate there, no framework.

    rollout: one decode step on every completion's row, through all layers, times `new_tokens` (prompt prefill
    ignored, as in the floor). logprobs and update: one micro-batch of `micro_rows` full sequences through one
    layer's products (forward; forward and both backward products), scaled to the layers and micro-batches.
    """
    shapes = linear_shapes(w, vocab)
    layer, head = shapes[:-1], shapes[-1:]
    tokens = w.micro_rows * (prompt_tokens + w.new_tokens)
    micro = w.completions / w.micro_rows
    decode = gemm_seconds(layer * w.layers + head, w.completions, backward=False, repeats=20)  # ms each: noisy

    def stack(backward: bool) -> float:
        return micro * (w.layers * gemm_seconds(layer, tokens, backward)
                        + gemm_seconds(head, tokens, backward))

    return {"rollout": w.new_tokens * decode, "logprobs": stack(False), "update": stack(True)}


def vocab_size(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def train_rows(w: Workload, model: Path) -> list[dict]:
    """The demo task's training rows, each question after `w.context` tokens of fixed context (the same for both
    frameworks: it is built from the model folder's tokenizer)."""
    from tandem.data import arithmetic

    rows = arithmetic.rows("train")
    if not w.context:
        return rows
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = " ".join(arithmetic.corpus()[: w.context])  # more tokens than needed: cut to exactly `context`
    context = tok.decode(tok(text)["input_ids"][: w.context]) + " "
    return [{**r, "question": context + r["question"]} for r in rows]


def prompt_tokens(w: Workload, model: Path) -> int:
    """The longest prompt of the workload, in tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return max(len(tok(r["question"])["input_ids"]) for r in train_rows(w, model))


class TrlTimes:
    """A TRL GRPOTrainer's seconds per step (`callback`) and per phase (`attach` wraps its generation, rewards and
    scoring), and the completion tokens of each generation."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.raw: list[dict[str, float]] = []  # per step: rollout, reward, gen+score (which holds both)
        self.tokens: list[int] = []

    def callback(self):
        from transformers import TrainerCallback

        times, raw = self.times, self.raw

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.start = time.perf_counter()
                raw.append({"rollout": 0.0, "reward": 0.0, "gen+score": 0.0})

            def on_step_end(self, args, state, control, **kw):
                times.append(time.perf_counter() - self.start)

        return StepTimer()

    def attach(self, trainer) -> None:
        def timed(name, fn, count_tokens=False):
            def wrapper(*a, **k):
                start = time.perf_counter()
                res = fn(*a, **k)
                self.raw[-1][name] += time.perf_counter() - start
                if count_tokens:
                    self.tokens.append(int(res["completion_mask"].sum()))
                return res
            return wrapper

        trainer._generate = timed("rollout", trainer._generate)
        trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
        trainer._generate_and_score_completions = timed("gen+score", trainer._generate_and_score_completions, True)

    def phases(self) -> list[dict[str, float]]:
        """Each step's rollout, reward, logprobs (the rest of generating and scoring: the reference forward and
        bookkeeping) and update (the rest of the step)."""
        return [{"rollout": p["rollout"], "reward": p["reward"],
                 "logprobs": p["gen+score"] - p["rollout"] - p["reward"], "update": t - p["gen+score"]}
                for p, t in zip(self.raw, self.times)]


# ---------------------------------------------------------------------------------------------- TRL child


def run_trl(w: Workload, model: Path, out: Path, steps: int, threads: int, device: str = "cpu",
            dtype: str = "float32", engine: str = "hf") -> dict:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    on_vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
               "vllm_max_model_length": prompt_tokens(w, model) + w.new_tokens + 8} if engine == "vllm" else {}

    def exact(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    timer = TrlTimes()

    args = GRPOConfig(
        output_dir=str(out), use_cpu=device == "cpu", bf16=dtype == "bfloat16", fp16=False,
        model_init_kwargs={"dtype": getattr(torch, dtype)}, gradient_checkpointing=False, seed=SEED, **on_vllm,
        per_device_train_batch_size=w.micro_rows, gradient_accumulation_steps=w.completions // w.micro_rows,
        steps_per_generation=w.completions // w.micro_rows, num_generations=w.generations,
        max_completion_length=w.new_tokens, max_steps=steps, learning_rate=LR, beta=KL, epsilon=CLIP,
        loss_type="dapo", scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, num_iterations=1,
        logging_steps=1, report_to=[], save_strategy="no", disable_dropout=True, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": w.new_tokens} if w.ignore_eos else None,
    )
    ds = Dataset.from_list([{"prompt": r["question"], "answer": r["answer"]} for r in train_rows(w, model)])
    trainer = GRPOTrainer(model=str(model), reward_funcs=exact, args=args, train_dataset=ds,
                          callbacks=[timer.callback()])
    timer.attach(trainer)
    trainer.train()
    return {"times": timer.times, "tokens": timer.tokens, "phases": timer.phases(), "rss_mb": peak_rss_mb()}


# ---------------------------------------------------------------------------------------------- tandem child


def run_tandem(w: Workload, model: Path, out: Path, steps: int, threads: int, engine: str = "hf",
               dtype: str = "float32") -> dict:
    from tandem.config import load_config
    from tandem.trainer import train

    plen = prompt_tokens(w, model)
    seq = plen + w.new_tokens
    data = ["data.max_prompt_tokens=8"]
    if w.context:  # the same rows as TRL's, from a file
        path = out.with_suffix(".rows.jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in train_rows(w, model)))
        data = ["data.task=jsonl", f"data.path={path}", f"data.eval_path={path}", f"data.max_prompt_tokens={plen}"]
    cfg = load_config(None, [*data,
        f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}", f"run.threads={threads}",
        f"run.seed={SEED}", "run.save_every=0", "run.progress=false", "run.report_to=[]", "run.plots=false",
        f"batch.prompts_per_step={w.prompts}", f"batch.group_size={w.generations}",
        f"batch.micro_batch_tokens={w.micro_rows * seq}",
        f"rollout.max_new_tokens={w.new_tokens}", f"rollout.ignore_eos={str(w.ignore_eos).lower()}",
        "data.eval_size=1", f"algo.kl_coef={KL}", "algo.kl_estimator=k3",
        "algo.loss_agg=token_mean", f"algo.clip_low={CLIP}", f"algo.clip_high={CLIP}", "algo.adv_eps=1e-4",
        f"optim.lr={LR}", "rewards=[{name: arithmetic_exact}]", "reward_pool.workers=0", f"rollout.engine={engine}",
        f"model.dtype={dtype}",
    ])  # the device: the GPU where one is visible (CUDA_VISIBLE_DEVICES="" keeps the CPU), as tandem's local backend
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    return {
        "times": [r["time/step"] for r in rows],
        "tokens": [round(r["completion/length_mean"] * w.completions) for r in rows],
        "phases": [{k[5:]: r[k] for k in ("time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync")}
                   for r in rows],
        "rss_mb": peak_rss_mb(),
    }


# ---------------------------------------------------------------------------------------------- parent


def child(framework: str, w: Workload, model: Path, work: Path, steps: int, threads: int, engine: str = "hf",
          device: str = "cpu", dtype: str = "float32", round_: int = 0) -> dict:
    """Run one framework in a fresh Python process (its own peak RSS, no state shared with the other). `engine`:
    the framework's rollout engine (hf: TRL's HF generate, tandem's embedded engine; or vllm); `round_`: which of
    the bench's rounds (each its own output folder)."""
    result = work / (f"{framework}-{engine}-{w.name}-{w.prompts}x{w.generations}"
                     f"x{w.new_tokens}-c{w.context}-r{round_}.json")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # both frameworks on the CPU, on a GPU machine too
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", framework,
           "--spec", w.to_json(), "--model", str(model), "--out", str(result), "--steps", str(steps),
           "--threads", str(threads), "--engine", engine,
           "--device", device, "--dtype", dtype]
    proc = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"{framework} on {w.name} failed (exit {proc.returncode})")
    return json.loads(result.read_text())


def summarize(rounds: list[dict], warmup: int) -> dict:
    """One framework's figures over its rounds: the medians of every measured step (after each round's warm-up)."""
    times = [t for r in rounds for t in r["times"][warmup:]]
    tokens = [n for r in rounds for n in r["tokens"][warmup:]]
    steps = [p for r in rounds for p in r["phases"][warmup:]]
    phases = {k: statistics.median(p[k] for p in steps) for k in steps[0]}
    return {"s_step": statistics.median(times), "tok_s": sum(tokens) / sum(times),
            "rss_mb": max(r["rss_mb"] for r in rounds), "phases": phases, "all": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["small", "large", "both"], default="both")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default: 5 small, 2 large)")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("--rounds", type=int, default=1,
                    help="each framework's child this many times, in turn (TRL, tandem, TRL, tandem, ...), the "
                         "products alone timed after each turn; figures are medians over every round's measured "
                         "steps (a framework's products alone: the median of its turns')")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    ap.add_argument("--frameworks", nargs="+", default=["trl", "tandem"], choices=["trl", "tandem"])
    ap.add_argument("--engine", choices=["hf", "vllm", "both"], default="hf",
                    help="tandem's rollout engine; both: tandem twice, side by side (TRL's: --trl-engine)")
    ap.add_argument("--trl-engine", choices=["hf", "vllm"], default="hf",
                    help="TRL's rollouts: its HF generate, or vLLM in its process (use_vllm, colocate mode: GPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where both frameworks run; cuda: the first GPU (not yet run on one), "
                    "CPU-only tables left out")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both frameworks' model dtype (bfloat16: TRL's bf16 on, tandem's model.dtype)")
    ap.add_argument("--child", choices=["trl", "tandem"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")

    if args.child:
        w = Workload(**json.loads(args.spec))
        out = Path(args.out).with_suffix(".run")
        if args.child == "trl":
            res = run_trl(w, Path(args.model), out, args.steps, args.threads, args.device, args.dtype, args.engine)
        else:
            res = run_tandem(w, Path(args.model), out, args.steps, args.threads, args.engine, args.dtype)
        Path(args.out).write_text(json.dumps(res))
        return

    import torch

    names = ["small", "large"] if args.workload == "both" else [args.workload]
    engines = ["hf", "vllm"] if args.engine == "both" else [args.engine]
    # (label, framework, tandem's engine): TRL once, tandem per engine
    runs = [("trl", "trl", args.trl_engine)] if "trl" in args.frameworks else []
    if "tandem" in args.frameworks:
        runs += [("tandem" if len(engines) == 1 else f"tandem-{e}", "tandem", e) for e in engines]
    labels = [label for label, *_ in runs]

    print(f"torch {torch.__version__}, threads={args.threads}, cores={os.cpu_count()}, tandem's engine: {args.engine}, "
          f"load average at start={os.getloadavg()}")
    on_cpu = args.device == "cpu"  # the machine-limit tables (products and attention alone) are the CPU's
    rate = matmul_gflops(args.threads, args.device, args.dtype)
    print(f"{args.dtype} matmul rate on {args.device}" + (f" at {args.threads} thread(s)" if on_cpu else "")
          + f": {rate:.1f} GFLOP/s; TRL's rollouts: {args.trl_engine}")
    table = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        work = Path(tmp)
        for name in names:
            w = WORKLOADS[name]
            steps = args.steps or (5 if name == "small" else 2)
            params = build_model(work / f"model-{name}", w)
            plen = prompt_tokens(w, work / f"model-{name}")
            phases = phase_flops(w, params, plen)
            flops = sum(phases.values())
            raw: dict[str, list[dict]] = {label: [] for label in labels}
            references: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
            for round_ in range(args.rounds):  # the frameworks in turn, so that each sees the machine's same drift
                for label, fw, engine in runs:
                    start = time.perf_counter()
                    raw[label].append(child(fw, w, work / f"model-{name}", work, args.warmup + steps, args.threads,
                                            engine, args.device, args.dtype, round_))
                    times = raw[label][-1]["times"][args.warmup:]
                    print(f"  {name:5s} {label:6s} round {round_ + 1}/{args.rounds} done in "
                          f"{time.perf_counter() - start:.0f} s, steps: " + ", ".join(f"{t:.3f}" for t in times)
                          + f"; load {os.getloadavg()[0]:.2f}", flush=True)
                    if on_cpu:  # the products alone, right after this turn: this framework's reference
                        references[label].append(achievable_seconds(w, vocab_size(work / f"model-{name}"), plen))
                if "trl" in raw and len(raw) > 1:
                    ref = statistics.median(raw["trl"][-1]["times"][args.warmup:])
                    print(f"  {name:5s} round {round_ + 1}: " + ", ".join(
                        f"{label}/TRL {statistics.median(raw[label][-1]['times'][args.warmup:]) / ref:.2f}"
                        for label in labels if label != "trl"), flush=True)
            res = {label: summarize(raw[label], args.warmup) for label in labels}
            if not on_cpu:
                table.append((w, params, flops, steps, res, phases, None, None, None))
                continue
            gemms = {label: {phase: statistics.median(r[phase] for r in refs) for phase in refs[0]}
                     for label, refs in references.items()}
            alone = decode_attention_seconds(w, plen)
            attention = {label: alone for label in labels}
            table.append((w, params, flops, steps, res, phases, gemms, attention,
                          training_attention_seconds(w, plen)))

    floor_note = f"floor = FLOPs / {rate:.1f} GFLOP/s"
    print(f"\nthreads={args.threads}; s/step = median of the measured steps after {args.warmup} warm-up; {floor_note}")
    head = f"{'workload':11s} {'framework':11s} {'s/step':>8s} {'compl tok/s':>11s} {'peak RSS MB':>11s} " \
           f"{'GFLOP/step':>10s} {'floor s':>8s} {'x floor':>7s} {'tandem/TRL':>10s}"
    print(head)
    print("-" * len(head))
    for w, params, flops, steps, res, *_ in table:
        floor = flops / (rate * 1e9)
        for fw, r in res.items():
            ratio = f"{r['s_step'] / res['trl']['s_step']:.2f}" if fw.startswith("tandem") and "trl" in res else ""
            print(f"{w.name:11s} {fw:11s} {r['s_step']:8.3f} {r['tok_s']:11.0f} {r['rss_mb']:11.0f} "
                  f"{flops / 1e9:10.1f} {floor:8.3f} {r['s_step'] / floor:7.2f} {ratio:>10s}")
        print(f"{'':11s} ({params / 1e6:.2f} M params, {w.prompts}x{w.generations} x {w.new_tokens} tokens, "
              f"{steps} measured steps x {args.rounds} round(s))")
    print("\nper-phase seconds (median over measured steps; TRL: rollout = _generate, logprobs = the rest of "
          "_generate_and_score_completions, update = the rest of the step)")
    for w, _, _, _, res, *_ in table:
        for fw, r in res.items():
            print(f"  {w.name:5s} {fw:6s} " + "  ".join(f"{k}={v:.3f}" for k, v in r["phases"].items()))
        for label, fw, engine in runs:
            if fw == "tandem":
                r = res[label]
                print(f"  {w.name:5s} {label} weight sync ({engine} engine, one process): "
                      f"{100 * r['phases']['sync'] / r['s_step']:.3f}% of the step")
    if not on_cpu:
        print(f"load average at end={os.getloadavg()}")
        return
    print(f"\neach phase against its floor share (its FLOPs / {rate:.1f} GFLOP/s) and against its matrix products "
          "alone at the phase's own shapes (`achievable_seconds`: the machine's rate there, no framework), timed "
          "after each of the framework's turns (GEMMs s: the median of those; GEMM GF/s: the phase's FLOPs at it)")
    head = f"{'workload':9s} {'phase':9s} {'floor s':>8s} " + " ".join(
        f"{fw + ' s':>11s} {'GEMMs s':>8s} {'GEMM GF/s':>9s} {'x floor':>7s} {'x GEMMs':>7s}" for fw in labels)
    print(head)
    print("-" * len(head))
    for w, _, _, _, res, phases, gemms, *_ in table:
        for phase, fl in phases.items():
            floor = fl / (rate * 1e9)
            line = f"{w.name:9s} {phase:9s} {floor:8.3f} "
            for fw in labels:
                t, alone = res[fw]["phases"][phase], gemms[fw][phase]
                line += f"{t:11.3f} {alone:8.3f} {fl / alone / 1e9:9.1f} {t / floor:7.2f} {t / alone:7.2f} "
            print(line)
    for w, *_, attention, _ in table:
        print(f"{w.name} rollout: its attention alone (one query per row, all layers and steps) takes, on top of "
              "its matrix products: " + "; ".join(f"{label} {a:.3f} s" for label, a in attention.items()))
    for w, *_, trained in table:
        print(f"{w.name} training: its attention alone (causal SDPA, every layer and micro-batch) takes "
              + ", ".join(f"{phase} {a:.3f} s" for phase, a in trained.items()))
    print("\nwhere each phase's time goes: its matrix products alone, its attention alone (the rollout's decode "
          "attention, the training phases' causal attention: all measured above), and the rest (overhead: dispatch, "
          "Python, sampling, copies, elementwise ops), as shares of the phase")
    head = f"{'workload':9s} {'phase':9s} " + " ".join(
        f"{fw + ' GEMM':>13s} {'attn':>5s} {'rest':>5s}" for fw in labels)
    print(head)
    print("-" * len(head))
    for w, _, _, _, res, phases, gemms, attention, trained in table:
        for phase in phases:
            line = f"{w.name:9s} {phase:9s} "
            for fw in labels:
                t = res[fw]["phases"][phase]
                attn = attention[fw] if phase == "rollout" else trained[phase]
                alone = gemms[fw][phase]
                line += f"{alone / t:13.2f} {attn / t:5.2f} {max(0.0, t - alone - attn) / t:5.2f} "
            print(line)
    print(f"load average at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
