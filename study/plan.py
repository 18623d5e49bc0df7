"""What a study will run, before it runs (`python study/run.py --dry-run` prints it, and a study
prints it as it starts): its cells and trials, how many trials run at once, and, for a
cluster-launcher config (`--cluster`), which node type the trials' workers land on and how many
trials the cluster holds at once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from study.spec.schema import StudySpec

ROOT = Path(__file__).resolve().parents[1]


def cluster_cpus(address: str | None) -> int:
    """CPUs of the embedded local Ray; 0 (unknown, the cluster decides) when joining a cluster."""
    return (os.cpu_count() or 1) if address is None else 0


def default_concurrency(spec: StudySpec, cpus: int) -> int | None:
    """Trials that fit at once on a local machine (Ray Train workers are not reserved by Tune, so
    running more would leave worker groups waiting for CPUs)."""
    r = spec.resources
    if r.max_concurrent_trials:
        return r.max_concurrent_trials
    if not cpus:
        return None
    return max(1, int(cpus // (r.workers_per_trial * r.cpus_per_worker)))


def machine_memory_lines(spec: StudySpec, concurrent: int | None) -> tuple[list[str], str | None]:
    """What the embedded Ray's machine holds (trial/limits.py's estimate): a line per trial and for the
    trials at once (or that none can run here: a GPU asked for where there is none), and why they
    cannot run together (None if they can): `concurrent` of the largest beyond the machine's memory."""
    import torch

    from trial.limits import GiB, estimate, memory_given

    r = spec.resources
    if r.gpus_per_worker and not torch.cuda.is_available():  # the run itself refuses it (run.py's local_shortfall)
        return [f"  on this machine: no trial can run (resources.gpus_per_worker {r.gpus_per_worker:g}, and no GPU "
                "here); plan it for a cluster with --cluster FILE, run it with --address"], None
    per_trial = max(estimate(spec.checked_config(c), r.workers_per_trial)[0] for c in spec.cells()) * r.workers_per_trial
    machine, _ = memory_given(0, 1, True)
    at_once = per_trial * (concurrent or 1)
    lines = [f"  memory: about {per_trial / GiB:,.1f} GiB a trial (the largest cell), {at_once / GiB:,.1f} GiB for "
             f"{concurrent or 1} at once, of this machine's {machine / GiB:,.1f} GiB"]
    if at_once > machine and not r.gpus_per_worker:
        fit = max(1, int(machine // per_trial))
        return lines, (f"resources.max_concurrent_trials: {concurrent} trials at once would hold about "
                       f"{at_once / GiB:,.1f} GiB, beyond this machine's {machine / GiB:,.1f} GiB "
                       f"({per_trial / GiB:,.1f} GiB a trial); set it to {fit} or fewer")
    return lines, None


def plan_lines(spec: StudySpec, max_concurrent: int | None, concurrency_from: str = "") -> list[str]:
    r = spec.resources
    per_trial = f"{r.workers_per_trial} worker(s) x {r.cpus_per_worker:g} CPU"
    if r.gpus_per_worker:
        per_trial += f" + {r.gpus_per_worker:g} GPU"
    cells = spec.cells()
    tasks = spec.grid.get("task.name")  # a grid over tasks: the spec's own task is only their default
    task = f"tasks {', '.join(map(str, tasks))}" if tasks else f"task {spec.task.name}"
    lines = [
        f"code: {ROOT}",
        f"study {spec.name}: {task}, {len(cells)} cell(s) x {spec.trials_per_cell} trial(s)"
        f" = {len(cells) * spec.trials_per_cell} trials",
        "  search: " + (f"none (replicas: {spec.replicas} seeds)" if spec.search is None else
                        f"{spec.search.sampler} over {', '.join(spec.search.params)}, "
                        f"{spec.search.trials_per_cell} trial(s) per cell"
                        + (" (tpe's first 10 are random draws; qmc spreads a few over the ranges)"
                           if spec.search.sampler == "tpe" and spec.search.trials_per_cell <= 10 else "")
                        + (f", then {spec.replicas - 1} replica(s) of the selected config (new seeds)"
                           if spec.replicas > 1 else "")),
        f"  objective: {spec.objective.mode} {spec.objective.metric}; scheduler: {spec.scheduler.type}",
        f"  per trial: {per_trial}, ZeRO-{r.zero_stage}{'' if r.bf16 is False else ', bf16' + (' mixed' if r.bf16 == 'mixed' else '')}; "
        f"concurrent trials: {max_concurrent or 'as the cluster fits'}"
        + (f" ({concurrency_from})" if concurrency_from and max_concurrent else ""),
    ]
    for c in cells:
        lines.append(f"  cell {c.index}: {c.label}")
    for claim in spec.claims:  # judged when the study ends (study/results/verdicts.py)
        at = f" at {claim.times:g}x" if claim.is_rate else ""
        lines.append(f"  claim {claim.name}: {claim.metric}{at}, {claim.rule}  [{claim.source}]")
    return lines


@dataclass(frozen=True)
class NodeFit:
    """A node type of a cluster config that holds at least one of a study's workers."""
    gpus: float
    cpus: float
    name: str
    per_node: int  # workers one node holds
    nodes: int  # nodes of the type the cluster may run (the head: 1)


def read_cluster(path: str) -> dict:
    """A cluster-launcher YAML (checked by study.spec.preflight.check_cluster_yaml first)."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def node_fits(spec: StudySpec, cluster: dict) -> list[NodeFit]:
    """The node types a worker of this spec fits on, the smallest first and, among equals, the
    higher `priority` (where Ray's autoscaler would place it)."""
    r = spec.resources
    need = {"CPU": r.cpus_per_worker, "GPU": r.gpus_per_worker}
    head = cluster.get("head_node_type")
    fits = []
    for name, node in cluster.get("available_node_types", {}).items():
        have = node.get("resources", {})
        per_node = min(int(have.get(k, 0) // v) for k, v in need.items() if v > 0)
        if per_node >= 1:
            nodes = 1 if name == head else node.get("max_workers", 0)
            fits.append((NodeFit(have.get("GPU", 0), have.get("CPU", 0), name, per_node, nodes),
                         -node.get("priority", 0)))  # spot before on-demand of the same size (autoscaler v2)
    return [fit for fit, _ in sorted(fits, key=lambda f: (f[0].gpus, f[0].cpus, f[1], f[0].name))]


def cluster_concurrency(spec: StudySpec, cluster: dict) -> int:
    """The most trials the cluster holds at once: the fitting node types at their max_workers, the
    whole cluster at its own max_workers (worker nodes; the head is one more), fullest nodes first."""
    fits = node_fits(spec, cluster)
    left = cluster.get("max_workers")
    left = left if isinstance(left, int) and left >= 0 else sum(f.nodes for f in fits)
    head = cluster.get("head_node_type")
    slots = 0
    for fit in sorted(fits, key=lambda f: -f.per_node):
        nodes = fit.nodes if fit.name == head else min(fit.nodes, left)
        left -= 0 if fit.name == head else nodes
        slots += nodes * fit.per_node
    return slots // spec.resources.workers_per_trial


def placement_lines(spec: StudySpec, cluster: dict, cluster_yaml: str, max_concurrent: int | None) -> list[str]:
    """Which node type of a cluster config the trials' workers land on, and whether the study's
    concurrency fits the node types' max_workers."""
    r = spec.resources
    fits = node_fits(spec, cluster)
    if not fits:
        need = {"CPU": r.cpus_per_worker, "GPU": r.gpus_per_worker}
        return [f"  node type: none in {cluster_yaml} fits a worker needing {need}"]
    first = fits[0]
    lines = [f"  node type: workers land on {first.name} ({first.gpus:g} GPU, {first.cpus:g} CPU; "
             f"{first.per_node} worker(s) per node)"
             + (f"; also fit: {', '.join(f.name for f in fits[1:])}" if len(fits) > 1 else "")]
    capacity = cluster_concurrency(spec, cluster)
    if (max_concurrent or 1) > capacity:
        lines.append(f"  warning: {max_concurrent} concurrent trials x {r.workers_per_trial} worker(s) need more "
                     f"worker slots than the fitting node types' max_workers give ({capacity} trials)")
    return lines
