"""Experiment configuration: YAML validated into typed, frozen pydantic objects.

Every model forbids unknown keys, so a typo is an error that names the key. Level
settings (``tree.root``, ``tree.server``, ``tree.edge``, ``tree.client``) give the
defaults of each level; ``tree.levels`` overrides ``tree.server`` for the intermediate
servers of one depth; ``tree.nodes`` overrides them for single nodes by id. The
``tree`` section's classes live in ``tree_schema.py`` and are re-exported here, where
callers find them. See docs/config.md for every key with an example.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from bhfl_core.config.base import Strict
from bhfl_core.config.data import DataConfig, KMeansClustering
from bhfl_core.config.tree_schema import (
    AggregateSettings,
    ClockSettings,
    DownResidual,
    DpSgdSettings,
    GroupSpec,
    LevelSettings,
    NodeOverride,
    OptKind,
    OptSettings,
    ResidualsConfig,
    StalenessSettings,
    TrainSettings,
    TreeConfig,
    UpResidual,
)
from bhfl_core.config.wrapper_schema import (
    AdaptiveClipSettings,
    CompressDownSettings,
    CompressSettings,
    PrivacySettings,
    SecureAggregationSettings,
    WrapSettings,
    ZeroingSettings,
)
from bhfl_core.learning.model_config import ModelConfig as ModelConfig  # noqa: PLC0414 (where callers find it)

__all__ = [  # the tree section's classes too (tree_schema.py): callers import them from here
    "AdaptiveClipSettings",
    "AggregateSettings",
    "ClockSettings",
    "ClusterTls",
    "CompressDownSettings",
    "CompressSettings",
    "DownResidual",
    "DpSgdSettings",
    "EvalConfig",
    "ExperimentConfig",
    "GroupSpec",
    "LevelSettings",
    "LocalAdaptation",
    "LocalOnlyBaseline",
    "ModelConfig",
    "NodeOverride",
    "OptKind",
    "OptSettings",
    "PrivacySettings",
    "ResidualsConfig",
    "RuntimeConfig",
    "SecureAggregationSettings",
    "StalenessSettings",
    "TrainSettings",
    "TreeConfig",
    "UpResidual",
    "WrapSettings",
    "ZeroingSettings",
    "dump",
]


# ---------------------------------------------------------------- runtime / eval


class ClusterTls(Strict):
    """The certificates this process shows a ``tls://`` Dask cluster, and the CA it trusts (PEM files).

    Dask's TLS is mutual: the scheduler and every worker accept only peers whose
    certificate ``ca_file`` signed, so a machine that merely reaches the port cannot
    submit code (docs/runtime.md, "A cluster over TLS"). Paths are made absolute here,
    so a resume from another folder finds them; only the paths are kept and logged,
    never what the files hold.
    """

    ca_file: str  # the CA that signed the scheduler's, the workers' and this client's certificates
    cert_file: str  # this client's certificate
    key_file: str  # its private key

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _absolute(cls, v: str) -> str:
        return str(Path(v).expanduser().absolute())


def plain_remote_host(address: str) -> str | None:
    """The host of a scheduler address that is neither encrypted nor on this machine (``tcp://10.0.0.1:8786``).

    Only ``tls://`` encrypts and authenticates; ``tcp://`` and ``ucx://`` carry whatever is
    sent, to whoever listens. Loopback (``127.x``, ``::1``, ``localhost``) stays on the
    machine. A host name is taken as remote: deciding otherwise would need DNS here.
    """
    scheme, _, _ = address.partition("://")
    if scheme not in ("tcp", "ucx"):
        return None
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return None
    try:
        return None if ipaddress.ip_address(host).is_loopback else host
    except ValueError:
        return host


class RuntimeConfig(Strict):
    """Where and how the work runs; none of these keys changes the results of a run.

    ``executor``: where client training, proxy training and evaluation run.
    ``local`` (default) starts a Dask cluster of worker processes on 127.0.0.1 for the
    run; ``cluster`` uses the Dask scheduler at ``cluster`` (``tcp://host:8786``), whose
    workers must see the run folder and the data cache at the same paths; ``inprocess``
    trains in the orchestrating process, one client at a time (debugging). ``workers``:
    worker processes of the local cluster (``auto``: one per GPU times
    ``workers_per_device``, or two sharing the CPU cores), or how many of the cluster's
    workers to use (``auto``: all). ``placement``: how a round's clients are spread over
    the workers (``lpt``: by optimizer steps, largest first; ``round_robin``;
    ``learned``: by time predicted from what each device kind measured).
    ``parallel_subtrees``: sibling servers of one round execute at the same time.
    ``subflow_depth``: internal nodes down to this depth (root = 0) execute as Prefect
    subflows, deeper ones inside their parent's subflow (their worker batches still are
    tasks); ``null``: every internal node is a subflow (the Prefect UI shows the tree).
    ``retries``: Prefect retries of a failed task (a worker's batch of clients, proxy
    training, an evaluation); finished clients of a retried batch are not trained again.
    ``on_client_failure``: a client that still fails after the retries either fails its
    node (``fail``: the run stops and can be resumed) or is left out of that round's
    aggregate (``drop``: logged and counted as ``Training/dropped_clients``). Resource
    errors (out of memory, disk full) always fail. ``transfer``: where models travel
    between the run's processes (``bhfl_core/store/transfer.py``): ``memory``
    (``/dev/shm``: one copy in RAM that every local process maps), ``run_folder``
    (``state/transfer``, which every worker of a ``cluster`` sees; the last models sent
    stay there for inspection), ``auto`` (memory when every process is on this machine
    and ``/dev/shm`` has 2 GiB free, else the run folder). ``tls``: the certificates of a
    ``tls://`` cluster (else Dask's own ``distributed.comm.tls.*`` settings are used).
    ``torch_threads``: intra-op threads of every training and evaluation call (1: parallelism
    comes from processes, and CPU reductions split the same way on every worker).
    ``trusted_network``: accept a plain ``tcp://`` scheduler on another machine (refused
    by default: anyone who reaches its port can run code on every worker).
    """

    executor: Literal["local", "cluster", "inprocess"] = "local"
    cluster: str | None = None
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    workers_per_device: Annotated[int, Field(ge=1)] = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    placement: Literal["lpt", "round_robin", "learned"] = "lpt"
    parallel_subtrees: bool = True
    subflow_depth: Annotated[int, Field(ge=0)] | None = None
    torch_threads: Annotated[int, Field(ge=1)] = 1
    retries: Annotated[int, Field(ge=0)] = 1
    retry_delay_s: Annotated[float, Field(ge=0)] = 1.0
    on_client_failure: Literal["fail", "drop"] = "fail"
    transfer: Literal["auto", "memory", "run_folder"] = "auto"
    tls: ClusterTls | None = None
    trusted_network: bool = False

    @field_validator("torch_threads", mode="before")
    @classmethod
    def _threads_unset_is_one(cls, v: object) -> object:
        """Run records written before the default was spelled out hold ``null``, which always meant 1."""
        return 1 if v is None else v

    @field_validator("cluster")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "tls://", "ucx://", "inproc://")):
            hint = " (Ray clusters are not supported: start a Dask scheduler instead)" if v.startswith("ray://") else ""
            raise ValueError(f"{v!r} is not a Dask scheduler address such as tcp://127.0.0.1:8786{hint}")
        return v

    @model_validator(mode="after")
    def _cluster_for_executor(self) -> RuntimeConfig:
        if self.executor == "cluster" and self.cluster is None:
            raise ValueError("executor: cluster needs runtime.cluster, the Dask scheduler's address (tcp://host:8786)")
        if self.executor == "cluster" and self.transfer == "memory":
            raise ValueError(
                "transfer: memory keeps models in this machine's /dev/shm, which the workers of a cluster do not "
                "see; use run_folder (or auto)"
            )
        if self.executor != "cluster" and self.cluster is not None:
            raise ValueError(
                f"cluster is set but executor is {self.executor!r}; set runtime.executor: cluster to use it"
            )
        return self._cluster_is_private()

    def _cluster_is_private(self) -> RuntimeConfig:
        """A cluster elsewhere speaks TLS, or the user said its network is theirs alone (``trusted_network``)."""
        address = self.cluster or ""
        if self.tls is not None and not address.startswith("tls://"):
            raise ValueError(
                f"runtime.tls: certificates are set but runtime.cluster is {address or 'not set'}; they are "
                "for a tls:// scheduler address (tls://host:8786)"
            )
        host = plain_remote_host(address)
        if host is not None and not self.trusted_network:
            raise ValueError(
                f"runtime.cluster: {address} is plain {address.partition(':')[0].upper()} to another machine "
                f"({host}): anyone who can reach that port can run code on every worker. Use tls://"
                f'{address.partition("://")[2]} with runtime.tls (docs/runtime.md, "A cluster over TLS"), or set '
                "runtime.trusted_network: true if only machines you trust can reach it"
            )
        return self


class LocalOnlyBaseline(Strict):
    """Each client trained from the initial model on its own train split only (no federation).

    ``rounds``: TRAIN calls with the client level's ``train`` settings; ``matched`` gives
    each client as many as it made in the federation (its round counter; at least 1).
    """

    rounds: Annotated[int, Field(ge=1)] | Literal["matched"] = "matched"


class LocalAdaptation(Strict):
    """Each client fine-tunes a final model (its parent server's, or the root's) on its own data."""

    source: Literal["parent", "root"] = Field("parent", alias="from")
    rounds: Annotated[int, Field(ge=1)] = 1  # TRAIN calls with the client level's train settings


class PrivacyAudit(Strict):
    """An empirical privacy audit (Andrew et al. 2024): ``canaries`` canary clients inserted at every DP server and
    as many held out; the report gives the epsilon their traces imply beside the analytical one."""

    canaries: Annotated[int, Field(ge=2)] = 200


class EvalConfig(Strict):
    """When and what is evaluated.

    By default the servers (root, intermediate, edge) are scored after every root round,
    so each server's MLflow run and the parent's root headlines have a curve (the servers
    are few: a fraction of the final evaluation's cost, measured in docs/evaluation.md);
    client and personal models, the many, are scored at the end only unless
    ``during: all``.
    """

    every: Annotated[int, Field(ge=0)] = 1  # evaluate every N root rounds (0: only at the end)
    during: Literal["servers", "all"] = "servers"  # the models those evaluations score (the final one: all)
    batch_size: Annotated[int, Field(ge=1)] = 256
    client_models: bool = True  # also evaluate persistent client models
    # the report's figures (PNG + SVG); false: its tables and text only, the same numbers (docs/evaluation.md)
    figures: bool = True
    # the population every model is scored on: every client, or a seeded sample of N (docs/evaluation.md "At scale")
    clients: Literal["all"] | Annotated[int, Field(ge=1)] = "all"
    # a client's models: its own split and up to K clients per ring of the tree around it ("all": every client)
    client_model_sample: Literal["all"] | Annotated[int, Field(ge=1)] = 20

    def sample_sizes(self) -> tuple[int | None, int | None]:
        """``(clients, client_model_sample)`` with ``all`` as None (bhfl_core/analysis/eval_plan.py)."""
        clients, per_ring = self.clients, self.client_model_sample
        return (None if clients == "all" else clients), (None if per_ring == "all" else per_ring)

    privacy_audit: PrivacyAudit | None = None  # canary clients at every DP server (docs/privacy.md, "Audit")
    local_only: LocalOnlyBaseline | None = None  # final evaluation: the local-only baseline (off: null)
    local_adaptation: LocalAdaptation | None = None  # final evaluation: locally fine-tuned models (off: null)


class ExperimentConfig(Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")] = "bhfl"
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    tree: TreeConfig = TreeConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _quantized_on_a_gpu(self) -> ExperimentConfig:
        if self.model.quantization is not None and self.runtime.device == "cpu":
            raise ValueError("model.quantization: bitsandbytes backbones need CUDA devices, and runtime.device is cpu")
        return self

    @model_validator(mode="after")
    def _groups(self) -> ExperimentConfig:
        languages = self.data.cluster_names()  # languages, or k-means clusters c0..cK-1
        kmeans = isinstance(self.data.clustering, KMeansClustering)
        where = "data.clustering (k-means clusters)" if kmeans else "data.source.languages"
        noun = "cluster" if kmeans else "language"
        if self.tree.flat and self.tree.groups:
            raise ValueError("tree.flat: a flat tree (root -> clients) cannot also have tree.groups")
        seen: dict[str, str] = {}
        for group in self.tree.group_specs():
            if group.name in languages:
                raise ValueError(f"{group.key}: a group name must differ from 'root' and from language/cluster names")
            if not group.leaf:
                continue
            for lang in group.members:
                if lang not in languages:
                    raise ValueError(f"{group.key}: {noun} {lang!r} is not in {where} {languages}")
                if lang in seen:
                    raise ValueError(f"{group.key}: {noun} {lang!r} is already under group {seen[lang]!r}")
                seen[lang] = group.name
        if self.tree.groups:
            missing = [lang for lang in languages if lang not in seen]
            if missing:
                raise ValueError(f"tree.groups: languages {missing} are not under any intermediate server")
        return self


def dump(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as plain data (JSON/YAML-safe)."""
    return config.model_dump(mode="json", by_alias=True)
