"""The job of tools/k8s.py: a training command's Kubernetes manifest (Kubeflow Trainer TrainJob or
Training Operator PyTorchJob, `launch.k8s`), checked as tools/train.py checks the command, with what
the pods request and what happens on a stop, a failure or a restart printed beside it.

The manifest writers (torch, about 2 s) are imported when the job runs, not for `--help`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from visiondist.cli import Command, config_text, load_config
from visiondist.config import ConfigError
from visiondist.models.registry import spec_of
from visiondist.plan.world import devices_named

# what each kind= writes
KIND_NAMES = {"trainjob": "TrainingRuntime and TrainJob", "pytorchjob": "PyTorchJob"}
# data.num_classes when it is unset and there is no data to count (the checkpoint's size)
DEFAULT_CLASSES = 1000


def _count(cmd: Command, key: str, default: int, least: int = 1) -> int:
    value = cmd.args.get(key, str(default))
    if not value.isdigit() or int(value) < least:
        raise ConfigError(f"{key}={value}: a whole number of at least {least}")
    return int(value)


def _check(cmd: Command, cfg, gpus: int) -> None:
    """What the pods would only find out at start (and be restarted for, again and again): one line
    each, here."""
    t, data = cfg.trainer, cfg.data
    given = [o.split("=", 1)[0] for o in cmd.overrides]
    if "trainer.run_dir" in given or "hydra.run.dir" in given:
        raise ConfigError(
            "the run dir is the job's: /runs/<name> on the claim pvc=; drop trainer.run_dir and "
            "choose it with name= (and pvc=)"
        )
    if OmegaConf.is_missing(data, "root"):
        raise ConfigError(
            f"data={data.name} needs data.root: its path inside the pods (data_pvc=<claim> mounts "
            "a claim at /data, e.g. data.root=/data/imagenet)"
        )
    under_data = str(data.root) == "/data" or str(data.root).startswith("/data/")
    if cmd.args.get("data_pvc") and not under_data:
        raise ConfigError(
            f"data_pvc= mounts its claim at /data but data.root={data.root}: use a path under /data"
        )
    if under_data and not cmd.args.get("data_pvc"):
        raise ConfigError(
            f"data.root={data.root} is under /data, where data_pvc=<claim> mounts the data: give "
            "data_pvc= (the PersistentVolumeClaim that holds it), or a data.root the image holds"
        )
    if t.accelerator == "cpu":
        raise ConfigError(
            "trainer.accelerator=cpu: the pods ask for GPUs (gpus=); drop trainer.accelerator"
        )
    if t.devices > 0 and t.devices != gpus:
        raise ConfigError(
            f"trainer.devices={t.devices} but each pod starts gpus={gpus} ranks: drop "
            "trainer.devices"
        )
    missing = sorted(OmegaConf.missing_keys(cfg) - {"data.num_classes", "model.num_classes"})
    if missing:
        raise ConfigError(f"{', '.join(missing)} must be given (???)")
    if not cmd.args["image"].strip() or any(c.isspace() for c in cmd.args["image"]):
        raise ConfigError(f"image={cmd.args['image']!r} is not an image reference (no spaces)")
    for key, what in (("pvc", "claim"), ("data_pvc", "claim"), ("image_pull_secret", "Secret")):
        value = cmd.args.get(key)
        if value and not re.fullmatch(r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?", value):
            raise ConfigError(
                f"{key}={value} is not a Kubernetes {what} name: lower-case letters, digits, '-' "
                "and '.'"
            )


def _check_resume(cmd: Command, name: str) -> None:
    """The pods continue their own run dir on every restart (trainer.resume=auto): another value
    would fail or go back at each restart. Before the config is read (its paths are the pods')."""
    given = [o.split("=", 1)[1] for o in cmd.overrides if o.startswith("trainer.resume=")]
    if not given or given[-1] == "auto":
        return
    value = given[-1]
    if value.lower() in ("null", "none", "false", ""):
        raise ConfigError(
            f"trainer.resume={value}: a restarted pod runs the command again, and a run dir that "
            "holds a run refuses a new start (exit code 2, a configuration error): drop "
            f"trainer.resume; the pods continue their run dir /runs/{name} (trainer.resume=auto)"
        )
    raise ConfigError(
        f"trainer.resume={value}: every restart would go back to that checkpoint, since the pods "
        f"continue their run dir /runs/{name} (trainer.resume=auto): to start from it, copy its "
        f"directory into /runs/{name}/checkpoints/ on the claim and drop trainer.resume"
    )


def k8s_job(cmd: Command, configs: Path) -> int:
    """tools/k8s.py's job: the manifest written (or printed) and what it does said on stderr;
    its exit code."""
    # torch (2 s): not for --help
    from visiondist.launch.k8s import (  # noqa: PLC0415 (a job's)
        JobSpec,
        default_name,
        grace_for,
        job_layout,
        manifests,
    )
    from visiondist.launch.k8s_policy import (  # noqa: PLC0415 (a job's)
        checkpoint_cost,
        staging_gib,
        what_happens,
    )
    from visiondist.launch.k8s_resources import pod_resources  # noqa: PLC0415 (a job's)
    from visiondist.launch.k8s_scheduling import scheduling  # noqa: PLC0415 (a job's)

    image = cmd.args.get("image")
    if not image:
        raise ConfigError(
            "image= is required: the container image with visiondist installed, e.g. "
            "image=registry.example.com/visiondist:1"
        )
    nodes, gpus = _count(cmd, "nodes", 2), _count(cmd, "gpus", 8)
    name = cmd.args.get("name") or default_name(cmd.overrides)
    _check_resume(cmd, name)
    cfg = load_config(configs, cmd.overrides + cmd.search, inputs=None)
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    if OmegaConf.is_missing(cfg.data, "num_classes"):
        cfg.data.num_classes = cfg.model.num_classes = DEFAULT_CLASSES
    _check(cmd, cfg, gpus)
    run = job_layout(cfg, nodes, gpus)
    stop = float(cfg.trainer.stop_timeout_s)
    staging = staging_gib(cfg, run)  # trainer.checkpoint_async's copy of a rank's state
    r = pod_resources(
        cfg, gpus, run.dp, cmd.args.get("cpu", ""), cmd.args.get("memory", ""), staging
    )
    spec = JobSpec(
        name=name,
        image=image,
        nodes=nodes,
        gpus=gpus,
        overrides=[o for o in cmd.overrides if not o.startswith("trainer.stop_timeout_s=")],
        grace_s=int(stop) if stop >= 0 else grace_for(cfg, run),
        pvc=cmd.args.get("pvc", "visiondist-runs"),
        data_pvc=cmd.args.get("data_pvc", ""),
        workdir=cmd.args.get("workdir", "/workspace/visiondist"),
        resources=r,
        pull_secret=cmd.args.get("image_pull_secret", ""),
        restarts=_count(cmd, "restarts", 3, least=0),
        rdma=cmd.args.get("rdma", ""),
        scheduling=scheduling(cmd.args),
    )
    kind = cmd.args.get("kind", "trainjob").lower()
    text = yaml.safe_dump_all(manifests(kind, spec), sort_keys=False, width=120)
    if cmd.args.get("out"):
        out = Path(cmd.args["out"])
        try:
            out.write_text(text)
        except OSError as exc:
            raise ConfigError(
                f"out={out}: cannot write it ({exc.strerror}): give a file in an existing directory"
            ) from None
        print(
            f"wrote {out} ({KIND_NAMES[kind]} {spec.name}): {spec.nodes} "
            f"pod{'s' if spec.nodes > 1 else ''} x {spec.gpus} GPUs, "
            f"{r.cpu} CPUs and {r.memory} memory each ({r.workers} loader workers a rank, "
            f"/dev/shm {r.shm}), run dir {spec.run_dir} on claim {spec.pvc}, "
            f"{spec.termination_grace_s} s grace after SIGTERM",
            file=sys.stderr,
        )
        print(
            f"kubectl apply -f {out} starts it; kubectl delete -f {out} stops it (the pods "
            f"checkpoint their step, up to {spec.termination_grace_s} s) and removes the "
            f"{KIND_NAMES[kind]}; the run dir stays on the claim",
            file=sys.stderr,
        )
    else:
        print(text, end="")
    if r.short:
        print(r.short, file=sys.stderr)
    if not cmd.args.get("name"):
        print(
            f"the job's name {spec.name} comes from model= and parallel= alone: its pods continue "
            f"the run in {spec.run_dir} wherever a job of that name ran before, whatever else its "
            "command changed; give name= for another experiment",
            file=sys.stderr,
        )
    if nodes > 1 and not spec.rdma:
        print(
            f"between the {nodes} pods NCCL runs over the pod network (TCP sockets): on a cluster "
            "with InfiniBand or RoCE, add rdma=<its RDMA device plugin's resource>:1, e.g. "
            "rdma=rdma/ib:1 (docs/multi-node.md)",
            file=sys.stderr,
        )
    grace = spec.termination_grace_s
    for line in what_happens(kind, spec.name, nodes, spec.restarts, grace, cfg.trainer):
        print(line, file=sys.stderr)
    cost = checkpoint_cost(cfg, run)
    if cost:
        print(cost, file=sys.stderr)
    _say_fit(cfg, run)
    return 0


def _say_fit(cfg, run) -> None:
    """On stderr: how the pods will fit the named layout to their GPUs (each does the same at its
    start), or that only they can check it (no parallel.device_memory_gb here)."""
    if run.fitted:
        print(f"{run.fitted} (each pod decides the same at its start)", file=sys.stderr)
    elif spec_of(cfg.model).planner_shape is None:
        return
    elif not devices_named(cfg.parallel):
        print(
            "the layout's memory is checked by each pod against its GPUs at start; "
            "parallel.gpu=<board> (e.g. h100) or parallel.device_memory_gb=<GB> checks it here, "
            "before the job is submitted",
            file=sys.stderr,
        )
    else:
        print(
            f"the pods run {run.describe(f'{run.world_size} GPUs')}: it fits their memory as "
            "planned here (each pod checks the same at its start)",
            file=sys.stderr,
        )
