"""The platform's speed, as ratios measured side by side in one run (this machine is shared and noisy).

    python -m benchmarks.suite                      # P1-P4, P7 and P8 here, P5 where CUDA is present
    python -m benchmarks.suite --only P1 P4 --json bench.json
    python -m benchmarks.suite --compare old.json   # print the ratios next to an earlier run's

P1 the model's training step against Hugging Face Llama, P2 trial start, P3 the share of a study in
train and eval steps, P4 KV-cached generation and data generation, P5 (CUDA only) bf16 tokens/s and
MFU under DeepSpeed ZeRO-2, P6 (only when named: `--only P6`) the study platform at scale
(benchmarks/scale.py), P7 a step of the field claims' cells in length groups against one padded
batch, P8 bf16 attention on CPU, the flash kernel against the math kernel. Every ratio is a median
over interleaved repeats. Results go to stdout and, with --json, to a file a later run can be
compared with (--compare). What each part measures, and its figures: docs/speed.md (P1-P5, P7, P8)
and docs/scale.md (P6).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.decoder import DecoderLM, ModelConfig  # noqa: E402
from models.encodings import ENCODINGS  # noqa: E402
from trial.host import matmul_tflops  # noqa: E402


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def step_flops(n_matmul_params: int, n_layers: int, d_model: int, seq: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4), plus causal
    attention's QK^T and AV (4 d T/2 forward per layer, x3 with backward)."""
    return 6 * n_matmul_params + 6 * n_layers * d_model * seq


# --- P1 --------------------------------------------------------------------------------------
def p1_train_step(d_model=256, n_layers=4, n_heads=4, seq=256, batch=16, vocab=256, repeats=7,
                  compile_too: bool = True) -> dict:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:  # `pip install -e ".[hf]"` (or ".[test]") brings it
        LlamaConfig = None

    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    ids = torch.arange(seq)[None].expand(batch, seq)
    d_ff_llama = round(8 * d_model / 3)  # SwiGLU's 3 matrices hold what a 4x GELU MLP's 2 do

    def ours(encoding, compiled=False, mixed=False):
        torch.manual_seed(0)
        m = DecoderLM(ModelConfig(vocab_size=vocab, max_position=seq, d_model=d_model, n_layers=n_layers,
                                  n_heads=n_heads, encoding=encoding))
        if compiled:  # what `deepspeed.compile` does: engine.compile is nn.Module.compile
            m.compile(dynamic=None)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):  # what `deepspeed.bf16: mixed` does
                logits, _, _ = m(tokens[:, :-1], ids)
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, step

    def llama():
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=d_ff_llama,
                          num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                          max_position_embeddings=seq, attn_implementation="sdpa", tie_word_embeddings=False)
        m = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            out = m(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, step

    runs = {f"ours_{e}": ours(e) for e in ENCODINGS}  # every registered encoding
    if compile_too:
        runs["ours_rope_compiled"] = ours("rope", compiled=True)
    runs["ours_rope_bf16_mixed"] = ours("rope", mixed=True)
    if LlamaConfig is not None:
        runs["hf_llama"] = llama()
    a = torch.randn(batch * seq, d_model)
    b = torch.randn(d_model, 4 * d_model)
    runs["matmul"] = (None, lambda: a @ b)
    times: dict[str, list[float]] = {k: [] for k in runs}
    first: dict[str, float] = {}
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # an empty inductor cache: the compile a fresh node's first trial pays (a warm one is seconds)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="p1-inductor-")
    try:
        for name, (_, step) in runs.items():  # warm-up (a compiled model builds its graphs here)
            first[name] = _timed(step, 1)[0]
    finally:
        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)
        if cache is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    for _ in range(repeats):  # interleaved, so a busy moment hits every contender alike
        for name, (_, step) in runs.items():
            times[name] += _timed(step, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens_per_step = batch * seq
    matmul_gflops = 2 * a.shape[0] * a.shape[1] * b.shape[1] / med["matmul"] / 1e9
    out = {"dims": dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq=seq, batch=batch, vocab=vocab),
           "threads": torch.get_num_threads(), "matmul_gflops": matmul_gflops, "models": {}}
    for name, (m, _) in runs.items():
        if m is None:
            continue
        n_matmul = sum(p.numel() for n, p in m.named_parameters() if p.dim() == 2 and "emb" not in n
                       and "embed_tokens" not in n)
        n_nonemb = sum(p.numel() for n, p in m.named_parameters() if "emb" not in n and "embed_tokens" not in n
                       and "lm_head" not in n)
        gflops = step_flops(n_matmul, n_layers, d_model, seq) * tokens_per_step / med[name] / 1e9
        out["models"][name] = {"tokens_per_s": tokens_per_step / med[name], "non_embedding_params": n_nonemb,
                               "gflops": gflops, "of_matmul": gflops / matmul_gflops}
    hf = out["models"].get("hf_llama", {}).get("tokens_per_s", float("nan"))
    for r in out["models"].values():
        r["vs_hf_llama"] = r["tokens_per_s"] / hf
    if compile_too:  # what compiling costs once, and how many steps it takes to earn it back
        compile_s = first["ours_rope_compiled"] - first["ours_rope"]
        saved = med["ours_rope"] - med["ours_rope_compiled"]
        out["compile"] = {"compile_s": compile_s, "step_s_eager": med["ours_rope"],
                          "step_s_compiled": med["ours_rope_compiled"], "speedup": med["ours_rope"] / med["ours_rope_compiled"],
                          "steps_to_repay": compile_s / saved if saved > 0 else None}
    out["bf16_mixed_speedup"] = med["ours_rope"] / med["ours_rope_bf16_mixed"]
    return out


def print_p1(r: dict) -> None:
    d = r["dims"]
    print(f"P1 train step, d {d['d_model']} x {d['n_layers']} layers, T {d['seq']}, B {d['batch']}, "
          f"{r['threads']} threads; fp32 matmul ceiling {r['matmul_gflops']:.1f} GFLOP/s")
    print(f"  {'model':<20}{'tokens/s':>10}{'vs HF':>8}{'GFLOP/s':>9}{'of matmul':>11}{'non-emb params':>16}")
    for name, m in r["models"].items():
        print(f"  {name:<20}{m['tokens_per_s']:>10.0f}{m['vs_hf_llama']:>8.2f}{m['gflops']:>9.1f}"
              f"{m['of_matmul']:>11.2f}{m['non_embedding_params']:>16,}")
    if "hf_llama" not in r["models"]:
        print("  (no Hugging Face Llama to compare with: pip install -e \".[hf]\")")
    if "compile" in r:
        c = r["compile"]
        repay = "never (no faster)" if c["steps_to_repay"] is None else f"{c['steps_to_repay']:.0f} steps"
        print(f"  torch.compile (rope): {c['compile_s']:.1f} s to compile (empty inductor cache), step {c['step_s_eager'] * 1e3:.0f} -> "
              f"{c['step_s_compiled'] * 1e3:.0f} ms ({c['speedup']:.2f}x); repaid after {repay}")
    if "bf16_mixed_speedup" in r:
        print(f"  bf16 mixed (rope, torch.autocast): {r['bf16_mixed_speedup']:.2f}x the fp32 step's tokens/s")


# --- P2 and P3: studies run as a user runs them -----------------------------------------------
def _run_study(spec: dict, workdir: Path, root: Path = ROOT) -> dict:
    """Run `study/run.py` (of the checkout `root`) on a spec; return its trials' `startup/*` and
    `time/*` metrics and the study's own (from its MLflow record, as the UI shows them), the driver's
    wall time, its output lines with the time each was read, and Tune's per-result warnings above
    0.1 s (TUNE_WARN_THRESHOLD_S; Ray prints them from 0.5 s by default)."""
    import yaml
    from mlflow.tracking import MlflowClient

    path = workdir / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    storage = workdir / "studies"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(root / "study/run.py"), "--space", str(path), "--storage", str(storage)],
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TUNE_WARN_THRESHOLD_S": "0.1"})
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    proc.wait(timeout=3600)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['name']} failed:\n" + "\n".join(text for _, text in lines[-40:]))
    slow = [float(m[1]) for _, text in lines if (m := re.search(r"took ([0-9.]+) s.*performance bottleneck", text))]
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    exp = client.get_experiment_by_name(spec["name"])
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("study.parent") == "true")
    trials = [{"trial_id": r.data.tags.get("tune.trial_id", ""),
               **{k: v for k, v in r.data.metrics.items() if k.startswith(("startup/", "time/"))}}
              for r in runs if r is not parent]
    return {"wall_s": wall, "study": dict(parent.data.metrics), "trials": trials, "lines": lines,
            "slow_results_s": slow, "ray_warnings": sum(" WARNING " in text for _, text in lines)}


def _smoke(name: str, **resources) -> dict:
    import yaml

    spec = yaml.safe_load((ROOT / "search_spaces/smoke.yaml").read_text())
    spec.update(name=name)
    spec["base"].pop("sparsity", None)
    spec["resources"].update(resources)
    return spec


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def p2_trial_start(baseline: str | None = None) -> dict:
    """The smoke study (4 trials) with warm processes (the default) and with a fresh process per
    trial, for 1-worker and 2-worker trials, one after the other; with `baseline` (another checkout),
    fresh 1-worker trials with its code too (`p2_1w_cold_before`), run just before ours; then
    `p2_two_worker_breakdown`."""
    out = {}
    runs = [(1, True, ROOT), *([(1, False, Path(baseline))] if baseline else []), (1, False, ROOT),
            (2, True, ROOT), (2, False, ROOT)]
    with tempfile.TemporaryDirectory(prefix="bench-p2-") as tmp:
        for workers, warm, root in runs:
            name = f"p2_{workers}w_{'warm' if warm else 'cold'}" + ("_before" if root != ROOT else "")
            d = Path(tmp) / name
            d.mkdir()
            res = _run_study(_smoke(name, workers_per_trial=workers, warm_processes=warm), d, root)
            stages = sorted({k for t in res["trials"] for k in t if k.startswith("startup/")})
            out[name] = {"workers": workers, "warm": warm, "study_wall_s": res["wall_s"],
                         "median": {k[len("startup/"):-2]: _median(res["trials"], k) for k in stages},
                         "from_schedule_s": sorted(t.get("startup/from_schedule_s", float("nan"))
                                                   for t in res["trials"])}
    out["two_worker"] = p2_two_worker_breakdown(baseline)
    return out


def print_p2(r: dict) -> None:
    print("P2 trial start: scheduled -> end of first training step (smoke study, 4 trials), s")
    stages = ["imports", "distributed", "task", "model", "engine", "data", "first_step", "total"]
    print(f"  {'study':<14}{'from schedule (each trial)':<32}" + "".join(f"{s[:9]:>10}" for s in stages)
          + f"{'wall':>7}")
    for name, m in r.items():
        if not isinstance(m, dict) or "from_schedule_s" not in m:
            continue
        each = " ".join(f"{v:.2f}" for v in m["from_schedule_s"])
        print(f"  {name:<14}{each:<32}" + "".join(f"{m['median'].get(s, float('nan')):>10.2f}" for s in stages)
              + f"{m['study_wall_s']:>7.0f}")
    if "p2_1w_cold_before" in r:
        before, after = (statistics.median(r[k]["from_schedule_s"]) for k in ("p2_1w_cold_before", "p2_1w_cold"))
        print(f"  fresh 1-worker trials, median start: before {before:.2f} s, after {after:.2f} s ({after / before:.2f}x)")
    if "two_worker" in r:
        print_p2_breakdown(r["two_worker"])
    for w in (1, 2):
        warm, cold = r.get(f"p2_{w}w_warm"), r.get(f"p2_{w}w_cold")
        if warm and cold:
            print(f"  {w}-worker trials: median start {statistics.median(warm['from_schedule_s']):.2f} s warm, "
                  f"{statistics.median(cold['from_schedule_s']):.2f} s cold "
                  f"({statistics.median(cold['from_schedule_s']) / statistics.median(warm['from_schedule_s']):.0f}x)")


# Ray Train's controller log lines that end a stage of a worker group's start (its sys log, JSON lines)
TRAIN_STAGES = (("controller", "Requesting resources"), ("placement_group", "Placement group ready"),
                ("worker_processes", "worker actors created"), ("process_group", "Train context initialized"),
                ("launch", "Started training worker group"), ("shutdown", "Shutting down"))


def _train_log_times(session_dir: str) -> dict[str, dict[str, float]]:
    """Per Ray Train run (`train-<trial id>`): the wall time each TRAIN_STAGES line was logged."""
    out: dict[str, dict[str, float]] = {}
    for path in Path(session_dir, "logs", "train").glob("ray-train-sys-controller-*.log"):
        for line in path.read_text().splitlines():
            d = json.loads(line)
            for stage, text in TRAIN_STAGES:
                if text in d.get("message", ""):
                    out.setdefault(d["run_name"], {}).setdefault(stage, d["timestamp_ns"] / 1e9)
    return out


def _trial_breakdown(res: dict) -> list[dict[str, float]]:
    """Each trial of a multi-worker study, from Tune starting it to Tune seeing it end, in stages
    (seconds): the driver's lines, Ray Train's controller log and the loop's own clock."""
    session = next(m[1] for _, t in res["lines"] if (m := re.search(r"session (\S+)$", t)))
    train = _train_log_times(session)
    started = {m[1]: ts for ts, t in res["lines"] if (m := re.search(r"started +.* #(\w+) ", t))}
    ended = {m[1]: ts for ts, t in res["lines"] if (m := re.search(r"finished .* #(\w+) ", t))}
    rows = []
    for tid, t0 in started.items():
        marks = next((v for k, v in train.items() if k.endswith(tid)), {})
        m = next((t for t in res["trials"] if t["trial_id"].endswith(tid)), None)
        if not marks or m is None or tid not in ended:
            continue
        row, last = {}, t0
        for stage, _ in TRAIN_STAGES[:-1]:
            row[stage], last = marks[stage] - last, marks[stage]
        first_step_at = last + m["startup/total_s"]  # the loop starts as Ray Train launches it
        for k in ("imports", "distributed", "engine", "data", "first_step"):
            row[k] = m.get(f"startup/{k}_s", 0.0)
        row["task_model_restore"] = sum(m.get(f"startup/{k}_s", 0.0) for k in ("task", "model", "restore"))
        steps = m["time/train_s"] + m["time/eval_s"]
        row["steps_and_eval"] = steps - row["first_step"]
        row["reports_checkpoints"] = marks["shutdown"] - first_step_at - row["steps_and_eval"]
        row["teardown"] = ended[tid] - marks["shutdown"]
        row["trial_wall"] = ended[tid] - t0
        row["overhead"] = row["trial_wall"] - steps
        rows.append(row)
    return rows


def p2_two_worker_breakdown(baseline: str | None = None, rounds: int = 1) -> dict:
    """A two-worker study: the smoke study's first cell, 2 trials one after the other, 40 steps, 2
    workers x 1 CPU, ZeRO-2. Per trial, where its time goes (`_trial_breakdown`), and the overhead
    per trial (wall time since Ray started, minus the trials' train and eval steps, over the trials).
    With `baseline` (another checkout of this repository), the same study run with its code too,
    interleaved, so that the two versions are measured side by side."""
    spec = _smoke("p2_2w_breakdown", workers_per_trial=2, cpus_per_worker=1, zero_stage=2)
    spec["base"]["optim"]["steps"] = 40
    spec["grid"] = {k: v[:1] for k, v in spec["grid"].items()}
    roots = {"after": ROOT, **({"before": Path(baseline)} if baseline else {})}
    runs: dict[str, list] = {k: [] for k in roots}
    with tempfile.TemporaryDirectory(prefix="bench-p2b-") as tmp:
        for i in range(rounds):
            for label, root in (sorted(roots.items()) if i % 2 else sorted(roots.items(), reverse=True)):
                d = Path(tmp) / f"{label}{i}"
                d.mkdir()
                res = _run_study(spec, d, root)
                wall, steps = res["study"].get("time/wall_since_ray_s"), res["study"].get("time/trials_in_steps_s")
                runs[label].append({"trials": _trial_breakdown(res), "overhead_per_trial": (wall - steps) / len(res["trials"]),
                                    "slow_results_s": res["slow_results_s"], "study_wall_s": res["wall_s"]})
    out = {}
    for label, rs in runs.items():
        trials = [t for r in rs for t in r["trials"]]
        out[label] = {"median": {k: _median(trials, k) for k in (trials[0] if trials else {})},
                      "overhead_per_trial": statistics.median(r["overhead_per_trial"] for r in rs),
                      "slowest_result_s": max((x for r in rs for x in r["slow_results_s"]), default=0.0), "runs": rs}
    return out


def print_p2_breakdown(r: dict) -> None:
    labels = [k for k in ("before", "after") if k in r]
    print("P2 2-worker trial, by stage (median over trials, s): " + " | ".join(labels)
          + (" | after/before" if len(labels) == 2 else ""))
    for stage in r[labels[-1]]["median"]:
        values = [r[k]["median"].get(stage, float("nan")) for k in labels]
        ratio = f"{values[1] / values[0]:>8.2f}" if len(values) == 2 and values[0] > 0.05 else ""
        print(f"  {stage:<22}" + "".join(f"{v:>9.2f}" for v in values) + ratio)
    print("  overhead per trial (wall since Ray - steps) / trials: "
          + ", ".join(f"{k} {r[k]['overhead_per_trial']:.1f} s" for k in labels)
          + "; slowest per-result driver step above 0.1 s: "
          + ", ".join(f"{k} {r[k]['slowest_result_s']:.2f} s" for k in labels))


def p3_study_share(spec_path: str | None = None) -> dict:
    """The share of a study's wall time since Ray started that its trials spent in train and eval
    steps: the default study unless a spec is given."""
    import yaml

    spec = yaml.safe_load((ROOT / (spec_path or "search_spaces/default.yaml")).read_text())
    with tempfile.TemporaryDirectory(prefix="bench-p3-") as tmp:
        res = _run_study(spec, Path(tmp))
    return {"spec": spec["name"], "study_wall_s": res["wall_s"], **res["study"],
            "trials": len(res["trials"]), "trial_train_s": sum(t.get("time/train_s", 0) for t in res["trials"]),
            "trial_eval_s": sum(t.get("time/eval_s", 0) for t in res["trials"])}


def print_p3(r: dict) -> None:
    print(f"P3 study '{r['spec']}', {r['trials']} trials: {r['study_wall_s']:.0f} s in all, "
          f"{r.get('time/wall_since_ray_s', float('nan')):.0f} s since Ray started; train {r['trial_train_s']:.0f} s + "
          f"eval {r['trial_eval_s']:.0f} s of trial time = {r.get('time/in_steps_share', float('nan')):.0%} of the "
          "trial slots' wall time")


# --- P4 --------------------------------------------------------------------------------------
def p4_generation_and_data(repeats: int = 5, configs: tuple[str, ...] | None = None) -> dict:
    """Greedy generation with and without the KV cache, and every task's batch generation time
    against a training step of its own model config (search_spaces/trials; `configs`: only these)."""
    import yaml

    from models import generate
    from trial.config import TrialConfig
    from trial.evaluate import Tensors, token_loss

    out = {"generation": {}, "data": {}}
    # generation: addition with coupled ids writes as many digits as it reads
    cfg = TrialConfig.model_validate(yaml.safe_load((ROOT / "search_spaces/trials/addition_coupled.yaml").read_text()))
    cfg = cfg.model_copy(update={"positional": cfg.positional.model_copy(update={"max_position": 256})})
    task = cfg.task_instance
    model = cfg.build_model(len(task.vocab)).eval()
    for factor in (1, 2, 4):
        n = task.train_length * factor
        batch = task.sample(32, np.random.default_rng(factor), length=n)
        P = int(batch.prompt_len[0])
        G = int(batch.seq_len[0]) - P
        tokens, ids = torch.from_numpy(batch.tokens), torch.from_numpy(batch.position_ids)
        oracle = ids[:, P:]

        def gen(cache):
            return lambda: generate(model, tokens[:, :P], ids[:, :P], G, "coupled", oracle_ids=oracle, use_cache=cache)
        cached, uncached = gen(True), gen(False)
        agree = (cached()[0] == uncached()[0]).float().mean().item()  # the same tokens, or the cache is wrong
        t = {"cached": [], "uncached": []}
        for _ in range(repeats):
            t["cached"] += _timed(cached, 1)
            t["uncached"] += _timed(uncached, 1)
        c, u = statistics.median(t["cached"]), statistics.median(t["uncached"])
        out["generation"][f"{factor}x"] = {"length": n, "new_tokens": G, "cached_s": c, "uncached_s": u,
                                           "speedup": u / c, "tokens_agree": agree}
    # data generation as a share of a training step, per task
    for path in sorted((ROOT / "search_spaces/trials").glob("*.yaml")):
        if configs is not None and path.stem not in configs:
            continue
        cfg = TrialConfig.model_validate(yaml.safe_load(path.read_text()))
        task = cfg.task_instance
        model = cfg.build_model(len(task.vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pos = cfg.positional
        rng = np.random.default_rng(0)

        def data():
            b = task.sample(cfg.optim.batch_size, rng)
            return b, pos.scheme.training_ids(b.position_ids, b.seq_len, rng)

        def step(b_ids=data()):  # noqa: B008 (one batch, drawn once: the step times the model, not the data)
            b, ids = b_ids
            loss, _, _ = token_loss(model, model, Tensors.from_batch(b, ids, torch.device("cpu")),
                                    pos.position_loss_weight)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        td, ts = [], []
        for _ in range(repeats):
            td += _timed(data, 1)
            ts += _timed(step, 1)
        d, s_ = statistics.median(td), statistics.median(ts)
        out["data"][path.stem] = {"task": task.name, "data_s": d, "step_s": s_, "share": d / (d + s_)}
    return out


def print_p4(r: dict) -> None:
    print("P4 greedy generation, addition (coupled ids), batch 32: KV cache vs re-running the sequence")
    for f, g in r["generation"].items():
        print(f"  {f} train length ({g['length']} digits, {g['new_tokens']} new tokens): cached {g['cached_s']:.3f} s, "
              f"uncached {g['uncached_s']:.3f} s, {g['speedup']:.1f}x; same tokens: {g['tokens_agree']:.0%}")
    print("  data generation as a share of (data + train step), each trial config's own batch and model:")
    for name, d in r["data"].items():
        print(f"    {name:<28}{d['data_s'] * 1e3:>8.1f} ms data {d['step_s'] * 1e3:>8.1f} ms step {d['share']:>6.1%}")


# --- P5 --------------------------------------------------------------------------------------
P5_DIMS = dict(d_model=1024, n_layers=12, n_heads=16, seq=2048, batch=8, vocab=32000)


KERNEL_KINDS = (("matmul", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas", re.I)),
                ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
                ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
                ("communication", re.compile(r"nccl", re.I)))


def profile_steps(step, device: torch.device, steps: int = 3) -> dict:
    """Where a step's time goes: the GPU's kernel time by kind (matmul, attention, optimizer,
    communication, the rest) as shares of the wall time; the remainder is the GPU idle (launches,
    Python, synchronisation). On CPU only the wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    kinds: dict[str, float] = {}
    if device.type == "cuda":
        from torch.autograd import DeviceType

        for e in prof.key_averages():
            # the kernels themselves: an operator's entry counts its kernels' time again
            us = e.self_device_time_total if e.device_type == DeviceType.CUDA else 0.0
            if us <= 0:
                continue
            kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(e.key)), "other kernels")
            kinds[kind] = kinds.get(kind, 0.0) + us
    shares = {k: v / wall_us for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    return {"step_ms": wall_us / steps / 1e3, "shares": shares, "gpu_idle": max(0.0, 1 - sum(shares.values()))}


def p5_gpu(steps: int = 10, dims: dict | None = None, device: str | None = None,
           compile_modes: tuple[bool, ...] = (False, True)) -> dict:
    """bf16 tokens/s and MFU at d 1024, 12 layers, T 2048 under ZeRO-2 on one GPU, eager and
    compiled, against the card's datasheet peak and its measured matmul rate, with a profile of
    where a step's time goes. Needs CUDA unless `device` says cpu (the device check's rehearsal)."""
    if device is None and not torch.cuda.is_available():
        return {"skipped": "no CUDA device here; run on a GPU machine (gpu/check.py)"}
    dev = torch.device(device or "cuda")
    import deepspeed

    from trial.session import setup_distributed

    setup_distributed()
    dims = {**P5_DIMS, **(dims or {})}
    d, L, H, T, B, V = (dims[k] for k in ("d_model", "n_layers", "n_heads", "seq", "batch", "vocab"))
    peak = float(os.environ.get("GPU_PEAK_BF16_TFLOPS", "989"))  # H100 SXM dense bf16; H200 the same
    measured = matmul_tflops(dev, n=8192 if dev.type == "cuda" else 512)
    out = {"dims": dims, "peak_tflops": peak, "matmul_tflops": measured}
    for compiled in compile_modes:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # each mode's own peak
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig(vocab_size=V, max_position=T, d_model=d, n_layers=L, n_heads=H, encoding="rope"))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_batch_size": B, "train_micro_batch_size_per_gpu": B, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {
                "lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9})  # torch's AdamW, as trials use
        if compiled:  # as the training loop does with `deepspeed.compile` (trial/loop.py)
            engine.compile(compile_kwargs={"dynamic": None})
        tokens = torch.randint(0, V, (B, T + 1), device=dev)
        ids = torch.arange(T, device=dev)[None].expand(B, T)
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

        def step():
            logits, _, _ = engine(tokens[:, :-1], ids)
            loss = F.cross_entropy(logits.float().reshape(-1, V), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up: the compiled engine builds its graphs here
            step()
        sync()
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        dt = (time.perf_counter() - t0) / steps
        n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n)
        flops = step_flops(n_matmul, L, d, T) * B * T
        out["compiled" if compiled else "eager"] = {
            "tokens_per_s": B * T / dt, "tflops": flops / dt / 1e12, "mfu": flops / dt / 1e12 / peak,
            "of_matmul": flops / dt / 1e12 / measured, "step_ms": dt * 1e3, "warmup_s": warmup_s,
            "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            "profile": profile_steps(step, dev)}
    if "eager" in out and "compiled" in out:
        e, c = out["eager"], out["compiled"]
        saved = 1 / e["tokens_per_s"] - 1 / c["tokens_per_s"]  # seconds per token
        out["compile"] = {"compile_s": c["warmup_s"] - e["warmup_s"], "speedup": c["tokens_per_s"] / e["tokens_per_s"],
                          "steps_to_repay": (c["warmup_s"] - e["warmup_s"]) / (saved * B * T) if saved > 0 else None}
    out["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    return out


def print_p5(r: dict) -> None:
    if "skipped" in r:
        print(f"P5 GPU: not run: {r['skipped']}")
        return
    dims = r["dims"]
    print(f"P5 {r['device']}, bf16, ZeRO-2, d {dims['d_model']} x {dims['n_layers']} layers, T {dims['seq']}, "
          f"B {dims['batch']}; matmul measured {r['matmul_tflops']:.0f} TFLOP/s, datasheet {r['peak_tflops']:.0f}:")
    for mode in ("eager", "compiled"):
        if mode not in r:
            continue
        m, p = r[mode], r[mode]["profile"]
        memory = "" if m["max_memory_gb"] is None else f"  peak memory {m['max_memory_gb']:.1f} GiB"
        print(f"  {mode:<9}{m['tokens_per_s']:>10.0f} tokens/s {m['tflops']:>7.1f} TFLOP/s  MFU {m['mfu']:.1%} "
              f"(of measured matmul {m['of_matmul']:.1%}){memory}")
        if p["shares"]:
            where = ", ".join(f"{k} {v:.0%}" for k, v in p["shares"].items())
            print(f"    a step ({p['step_ms']:.1f} ms): {where}, GPU idle {p['gpu_idle']:.0%}")
    if "compile" in r:
        c = r["compile"]
        repay = "never (no faster)" if c["steps_to_repay"] is None else f"{c['steps_to_repay']:.0f} steps"
        print(f"  torch.compile: {c['compile_s']:.1f} s to compile, {c['speedup']:.2f}x per step; repaid after {repay}")


# --- P7 --------------------------------------------------------------------------------------
def p7_length_groups(steps: int = 24, claims: tuple[str, ...] | None = None, groups: int = 4) -> dict:
    """A training step of each field claim's cell (the claims of FIELD_CLAIM_SPECS) on its own batches: one
    batch padded to its longest sequence against the same batch in `groups` length groups
    (`optim.length_groups`), interleaved step by step, with the share of the computed tokens that
    are not padding. The module and AdamW as the engine runs them (autocast where the spec says
    `bf16: mixed`), without DeepSpeed, whose step is the same either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a trial runs on one core here
    try:
        return _p7_cells(steps, claims, groups)
    finally:
        torch.set_num_threads(threads)


FIELD_CLAIM_SPECS = ("schemes_abacus_train10", "schemes_randomized_encoder", "schemes_multiplication_coupled",
                     "schemes_randomized_published")


def _claim_configs(claims: tuple[str, ...] | None):
    """The trial config (seed 0) of each cell the field's claims compare (`claims`: those named), the
    costliest first."""
    from study.spec.schema import load_spec

    configs = []
    for name in FIELD_CLAIM_SPECS:
        spec = load_spec(str(ROOT / "search_spaces" / "experiments" / f"{name}.yaml"))
        for claim in spec.claims:
            if claims is not None and claim.name not in claims:
                continue
            cells = {c.index: c for c in spec.claim_cells(claim) if c is not None}
            configs += [spec.checked_config(c) for c in cells.values()]
    return sorted(configs, key=lambda c: -c.n_parameters() * c.optim.steps * c.optim.batch_size)


def _claim_cells(steps: int, claims: tuple[str, ...] | None, bf16_only: bool = False):
    """Each field claim's cell once (the first seed's trial): its name, config, module (seeded), AdamW,
    `steps` of its own batches, and the autocast its spec's precision asks for."""
    import contextlib

    from trial.batches import StepBatches
    from trial.evaluate import Tensors

    seen = set()
    for cfg in _claim_configs(claims):
        name = f"{cfg.task.name}, {cfg.positional.encoding}, {cfg.positional.ids}" + \
            (", abacus" if cfg.positional.abacus else "") + (", encoder" if cfg.model.output == "encoder" else "")
        if name in seen or (bf16_only and not cfg.deepspeed.bf16):
            continue
        seen.add(name)
        task = cfg.task_instance
        torch.manual_seed(0)
        model = cfg.build_model(len(task.vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = StepBatches(task, cfg.positional.scheme, cfg.optim.batch_size, 0, 0, 1, steps)
        xs = [(Tensors(i["tokens"], i["ids"], i["loss_mask"], i["answer_mask"], i.get("places")), i["tokens_seen"])
              for i in (batches[n] for n in range(len(batches)))]  # a Dataset: no end of its own when iterated
        mixed = torch.autocast("cpu", torch.bfloat16) if cfg.deepspeed.bf16 == "mixed" else contextlib.nullcontext()
        yield name, cfg, model, opt, xs, mixed


def _train_step(model, opt, x, mixed, groups: int):
    from trial.evaluate import token_loss

    def step():
        with mixed:
            loss, _, _ = token_loss(model, model, x, 0.0, groups)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _p7_cells(steps: int, claims: tuple[str, ...] | None, groups: int) -> dict:
    out = {}
    for name, cfg, model, opt, xs, mixed in _claim_cells(steps, claims):
        times, computed, real = {1: [], groups: []}, {1: 0, groups: 0}, 0
        for x, tokens in xs:
            real += tokens
            for k in times:
                times[k] += _timed(_train_step(model, opt, x, mixed, k), 1)
                computed[k] += sum(g.tokens.numel() for g in x.by_length(k))
        one, grouped = statistics.median(times[1][2:] or times[1]), statistics.median(times[groups][2:] or times[groups])
        out[name] = {"model": f"{cfg.model.n_layers} layers of d {cfg.model.d_model}", "bf16": cfg.deepspeed.bf16,
                     "one_batch_s": one, "grouped_s": grouped, "speedup": one / grouped, "groups": groups,
                     "not_padding_one": real / computed[1], "not_padding_grouped": real / computed[groups]}
    return out


def print_p7(r: dict) -> None:
    print("P7 a step of each field claim's cell on its own batches: one padded batch vs length groups "
          "(optim.length_groups), interleaved, one thread")
    for name, c in r.items():
        if isinstance(c, dict):
            print(f"  {name:<42}{c['model']:<20} one batch {c['one_batch_s'] * 1e3:>7.1f} ms "
                  f"({c['not_padding_one']:.0%} not padding), {c['groups']} groups {c['grouped_s'] * 1e3:>7.1f} ms "
                  f"({c['not_padding_grouped']:.0%}): {c['speedup']:.2f}x")


# --- P8 --------------------------------------------------------------------------------------
def p8_attention_kernel(keys=(16, 32, 64, 128, 256, 512), repeats: int = 5, steps: int = 24,
                        claims: tuple[str, ...] | None = None) -> dict:
    """bf16 attention on CPU, PyTorch's flash kernel against its math kernel: a forward and backward
    of causal attention at each number of keys (2,048 tokens a batch, 4 heads of 64), and a training
    step of each bf16 field claim's cell in its length groups with the flash kernel against the
    model's own choice (models/decoder.py, `attention_kernel`: math at most MATH_ATTENTION_MAX_KEYS
    keys), interleaved, one thread. Where the crossover sits depends on the CPU: this part finds it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a trial runs on one core here
    try:
        return {"kernels": _p8_kernels(keys, repeats), "cells": _p8_cells(steps, claims)}
    finally:
        torch.set_num_threads(threads)


def _p8_kernels(keys, repeats: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for n in keys:
        q, k, v = (torch.randn(max(1, 2048 // n), 4, n, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        times = {SDPBackend.FLASH_ATTENTION: [], SDPBackend.MATH: []}
        for _ in range(repeats + 1):
            for backend in times:
                def step(backend=backend):
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                times[backend] += _timed(step, 1)
        flash, math_ = (statistics.median(t[1:]) for t in times.values())  # the first of each: warm-up
        out[str(n)] = {"flash_s": flash, "math_s": math_, "flash_over_math": flash / math_}
    return out


def _p8_cells(steps: int, claims: tuple[str, ...] | None) -> dict:
    import models.decoder as decoder

    out, chosen = {}, decoder.MATH_ATTENTION_MAX_KEYS
    for name, cfg, model, opt, xs, mixed in _claim_cells(steps, claims, bf16_only=True):
        times = {"flash": [], "chosen": []}
        try:
            for x, _ in xs:
                for kernel in times:
                    decoder.MATH_ATTENTION_MAX_KEYS = chosen if kernel == "chosen" else -1
                    times[kernel] += _timed(_train_step(model, opt, x, mixed, cfg.optim.length_groups), 1)
        finally:
            decoder.MATH_ATTENTION_MAX_KEYS = chosen
        flash, mine = (statistics.median(t[2:] or t) for t in times.values())
        out[name] = {"model": f"{cfg.model.n_layers} layers of d {cfg.model.d_model}", "flash_s": flash,
                     "chosen_s": mine, "speedup": flash / mine}
    return out


def print_p8(r: dict) -> None:
    print("P8 bf16 attention on CPU, one thread: flash kernel vs math kernel, forward and backward, by keys")
    for n, row in r["kernels"].items():
        print(f"  {n:>5} keys  flash {row['flash_s'] * 1e3:7.1f} ms  math {row['math_s'] * 1e3:7.1f} ms  "
              f"flash / math {row['flash_over_math']:.2f}")
    for name, c in r["cells"].items():
        print(f"  a step of {name} ({c['model']}): flash {c['flash_s'] * 1e3:.1f} ms, the model's kernel "
              f"{c['chosen_s'] * 1e3:.1f} ms: {c['speedup']:.2f}x")


# --- P6 --------------------------------------------------------------------------------------
def p6_scale(trials=(100, 300), nodes: int = 2, profile_dir: str | None = None) -> dict:
    """The platform at scale on a simulated multi-node cluster (benchmarks/scale.py)."""
    from benchmarks.scale import p6_scale as run

    return run(trials, nodes, profile_dir=profile_dir)


def print_p6(r: dict) -> None:
    from benchmarks.scale import print_p6 as show

    show(r)


PARTS = {"P1": (p1_train_step, print_p1), "P2": (p2_trial_start, print_p2), "P3": (p3_study_share, print_p3),
         "P4": (p4_generation_and_data, print_p4), "P5": (p5_gpu, print_p5), "P6": (p6_scale, print_p6),
         "P7": (p7_length_groups, print_p7), "P8": (p8_attention_kernel, print_p8)}
DEFAULT_PARTS = ["P1", "P2", "P3", "P4", "P5", "P7", "P8"]  # P6 takes long: only when named
HEADLINES = {  # (part, path into its result, what it is) for --compare
    "P1 rope vs HF Llama": ("P1", ["models", "ours_rope", "vs_hf_llama"]),
    "P1 rope of matmul": ("P1", ["models", "ours_rope", "of_matmul"]),
    "P1 bf16 mixed / fp32": ("P1", ["bf16_mixed_speedup"]),
    "P2 1-worker start, warm (s)": ("P2", ["p2_1w_warm", "median", "total"]),
    "P2 2-worker overhead/trial (s)": ("P2", ["two_worker", "after", "overhead_per_trial"]),
    "P3 share in steps": ("P3", ["time/in_steps_share"]),
    "P4 cache speed-up at 4x": ("P4", ["generation", "4x", "speedup"]),
    "P6 overhead/trial at N=100 (ms)": ("P6", ["100", "driver_overhead_ms_per_trial"]),
    "P7 length groups, reversal encoder": ("P7", ["reverse, learned, sequential, encoder", "speedup"]),
    "P8 bf16 Abacus step, math / flash": ("P8", ["cells", "addition, nope, sequential, abacus", "speedup"]),
}


def _dig(d: dict, path: list[str]):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(PARTS), help="run these parts only")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--compare", help="an earlier --json file: print its headline ratios beside these")
    parser.add_argument("--p3-spec", help="the study P3 runs (default: search_spaces/default.yaml, ~8 min)")
    parser.add_argument("--p2-baseline", help="P2: another checkout of this repository (`git worktree add DIR "
                        "REV`): its code runs the same studies, interleaved, as `before`")
    parser.add_argument("--trials", type=int, nargs="+", default=[100, 300], help="P6: study sizes N")
    parser.add_argument("--nodes", type=int, default=2, help="P6: simulated worker nodes M")
    parser.add_argument("--p6-profile", help="P6: cProfile each first study's driver into this folder")
    args = parser.parse_args(argv)
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                           "cuda": torch.cuda.is_available()},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for name in args.only or DEFAULT_PARTS:
        run, show = PARTS[name]
        t0 = time.time()
        if name == "P3":
            results[name] = run(args.p3_spec)
        elif name == "P2":
            results[name] = run(args.p2_baseline)
        elif name == "P6":
            results[name] = run(args.trials, args.nodes, args.p6_profile)
        else:
            results[name] = run()
        results[name]["seconds"] = time.time() - t0
        show(results[name])
        print(flush=True)
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        print(f"against {args.compare} ({before.get('started')}):")
        for label, (part, path) in HEADLINES.items():
            old, new = _dig(before.get(part, {}), path), _dig(results.get(part, {}), path)
            if old is not None or new is not None:
                print(f"  {label:<30}{old if old is None else round(old, 3)!s:>10} -> "
                      f"{new if new is None else round(new, 3)!s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
