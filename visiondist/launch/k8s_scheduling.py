"""Where a Kubernetes job of `tools/k8s.py` may run and how it waits its turn: the pods' node
selector, tolerations and priority class, and the job's Kueue queue (`visiondist.launch.k8s` writes
them into the manifest). A GPU cluster usually keeps its GPU nodes for GPU pods with a taint and
labels them by board, and admits jobs through a queue: without these the pods wait unscheduled,
or land on the wrong board, and the job is refused by a cluster that requires a queue.

    node_selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3,pool=train
    tolerations=nvidia.com/gpu:NoSchedule,dedicated=ml:NoExecute
    priority_class=high queue=team-a

Each key and value is checked as the API server would check it, so that a typo is refused here,
not by `kubectl apply`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from visiondist.config import ConfigError

# the label Kueue reads a job's LocalQueue from (TrainJob and PyTorchJob alike)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS_NAME = r"[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?"
_QUEUE = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


@dataclass(frozen=True)
class Scheduling:
    """The pods' placement and the job's queue; empty: none of them in the manifest."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    priority_class: str = ""
    queue: str = ""

    def pod_fields(self) -> dict[str, Any]:
        """What each pod's spec gets."""
        fields: dict[str, Any] = {}
        if self.node_selector:
            fields["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            fields["tolerations"] = [dict(t) for t in self.tolerations]
        if self.priority_class:
            fields["priorityClassName"] = self.priority_class
        return fields

    def job_labels(self) -> dict[str, str]:
        """What the job's own metadata gets (the TrainJob, the PyTorchJob)."""
        return {QUEUE_LABEL: self.queue} if self.queue else {}


def _label_key(key: str, given: str) -> str:
    prefix, _, name = key.rpartition("/")
    if (
        not re.fullmatch(_NAME, name)
        or len(prefix) > 253
        or ("/" in key and not re.fullmatch(_PREFIX, prefix))
    ):
        raise ConfigError(
            f"{given}: {key!r} is not a Kubernetes label key: an optional DNS prefix and '/', then "
            "up to 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric "
            "(kubectl get nodes --show-labels lists the nodes' keys)"
        )
    return key


def _label_value(value: str, given: str) -> str:
    if value and not re.fullmatch(_NAME, value):
        raise ConfigError(
            f"{given}: {value!r} is not a Kubernetes label value: up to 63 letters, digits, '-', "
            "'_' or '.', starting and ending alphanumeric"
        )
    return value


def node_selector(text: str) -> dict[str, str]:
    """`node_selector=<key>=<value>[,<key>=<value>...]`: the node labels every pod's node must
    have."""
    given = f"node_selector={text}"
    selector: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(
                f"{given}: {item!r} needs a value: <label>=<value>, e.g. "
                "node_selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 (pairs joined by ',')"
            )
        selector[_label_key(key.strip(), given)] = _label_value(value.strip(), given)
    return selector


def tolerations(text: str) -> list[dict[str, str]]:
    """`tolerations=<key>[=<value>][:<effect>][,...]`: the taints the pods tolerate; a key alone
    tolerates the taint whatever its value (operator Exists), a key and value that value (Equal);
    without an effect, every effect of it."""
    given = f"tolerations={text}"
    out: list[dict[str, str]] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        taint, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
        if colon and effect not in EFFECTS:
            raise ConfigError(
                f"{given}: {item!r} is not <key>[=<value>][:<effect>] with an effect of "
                f"{', '.join(EFFECTS)}, e.g. tolerations=nvidia.com/gpu:NoSchedule "
                "(kubectl describe node lists its Taints)"
            )
        key, eq, value = taint.partition("=")
        toleration = {"key": _label_key(key.strip(), given)}
        if eq:
            toleration |= {"operator": "Equal", "value": _label_value(value.strip(), given)}
        else:
            toleration["operator"] = "Exists"
        out.append({**toleration, **({"effect": effect} if effect else {})})
    return out


def scheduling(args: dict[str, str]) -> Scheduling:
    """The tool's scheduling keys, checked."""
    priority, queue = args.get("priority_class", ""), args.get("queue", "")
    if priority and not re.fullmatch(_DNS_NAME, priority):
        raise ConfigError(
            f"priority_class={priority} is not a PriorityClass name: lower-case letters, digits, "
            "'-' and '.' (kubectl get priorityclass lists them)"
        )
    if queue and not re.fullmatch(_QUEUE, queue):
        raise ConfigError(
            f"queue={queue} is not a Kueue LocalQueue name: lower-case letters, digits and '-', "
            "63 at most (kubectl get localqueues lists them)"
        )
    return Scheduling(
        node_selector=node_selector(args.get("node_selector", "")),
        tolerations=tolerations(args.get("tolerations", "")),
        priority_class=priority,
        queue=queue,
    )
