"""Settings of the Kubernetes provider: flags of `sandpool controller --provider kubernetes`.

Every field is a `--kube-*` flag (`--kubeconfig` keeps its familiar name) and a
`SANDPOOL_KUBE_*` variable. The prefix keeps them apart from the controller's own
flags when its CLI adds both classes to one parser.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from sandpool.controller.quantities import parse_quantity
from sandpool.core.settings import ServiceSettings

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class KubernetesProviderSettings(ServiceSettings):
    kubeconfig: Path | None = Field(default=None, description=(
        "kubeconfig file to reach the cluster. Unset: the in-cluster service account when running "
        "in a pod, else $KUBECONFIG or ~/.kube/config"))
    kube_context: str | None = Field(default=None, description="kubeconfig context (default: its current one)")
    kube_namespace: str = Field(default="sandpool-sandboxes", pattern=DNS_LABEL, description=(
        "Namespace the sandbox pods and their Secrets live in"))
    kube_installation: str = Field(default="sandpool", pattern=r"^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$",
                                   description=(
        "Name of this installation: the `sandpool.dev/installation` label on every pod it makes, "
        "and the prefix of their names. Two installations sharing a namespace need two names"))
    kube_agent_port: int = Field(default=8080, ge=1, le=65535, description="Port the agent listens on in a pod")
    kube_sandbox_uid: int = Field(default=1000, ge=1, description="Non-root uid (and gid) sandbox pods run as")
    kube_tmp_size: str = Field(default="64Mi", description="Size limit of the pod's /tmp emptyDir")
    kube_image_pull_policy: str = Field(default="IfNotPresent", pattern=r"^(Always|IfNotPresent|Never)$",
                                        description="imagePullPolicy of sandbox pods")
    kube_priority_class: str | None = Field(default=None, description=(
        "priorityClassName of sandbox pods (e.g. a low one so warm pods are evicted first)"))
    kube_service_account: str | None = Field(default=None, description=(
        "serviceAccountName of sandbox pods (its token is never mounted)"))
    kube_termination_grace_seconds: int = Field(default=2, ge=0, le=300, description=(
        "terminationGracePeriodSeconds of sandbox pods: a sandbox holds nothing worth a long goodbye"))

    kube_egress_proxy: str | None = Field(default=None, pattern=r"^([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$",
                                          description=(
        "HOST:PORT of the egress proxy's Service (the chart sets it with egress.enabled): each sandbox pod gets "
        "an egress credential in its Secret, and its agent hands sandboxed code the proxy URL. A name is "
        "resolved here, by the controller: sandbox pods have no DNS. Unset: sandboxes have no egress"))

    kube_create_rate: float = Field(default=10.0, gt=0, description=(
        "Sandbox creations per second sustained (each is a Pod and a Secret POST): token bucket rate"))
    kube_create_burst: int = Field(default=10, ge=1, description="Creations allowed at once before the rate applies")
    kube_delete_rate: float = Field(default=20.0, gt=0, description="Pod deletions per second sustained")
    kube_delete_burst: int = Field(default=20, ge=1, description="Deletions allowed at once before the rate applies")
    kube_max_inflight: int = Field(default=16, ge=1, description=(
        "Kubernetes API calls in flight at once (threads of the client's executor)"))
    kube_api_timeout_seconds: float = Field(default=10.0, gt=0, description="Timeout of each Kubernetes API call")
    kube_max_retries: int = Field(default=5, ge=0, description=(
        "Retries of an API call after 429, 5xx or a connection error (bounded backoff, honours Retry-After)"))
    kube_backoff_max_seconds: float = Field(default=8.0, gt=0, description="Longest wait between two retries")
    kube_watch_timeout_seconds: int = Field(default=300, ge=5, description=(
        "Server-side length of one watch request; the watch then resumes from its last resourceVersion"))
    kube_relist_seconds: float = Field(default=600.0, gt=0, description=(
        "List all pods afresh at least this often (when a watch request ends), so a missed event "
        "cannot outlive one period"))
    kube_ready_timeout_seconds: float = Field(default=120.0, gt=0, description=(
        "How long a new pod may take to be Ready and answer /healthz before it is deleted"))
    kube_health_timeout_seconds: float = Field(default=2.0, gt=0, description=(
        "Timeout of one /healthz probe of a new pod's agent by the provider"))

    @field_validator("kube_tmp_size")
    @classmethod
    def _tmp_size(cls, value: str) -> str:
        parse_quantity(value)  # a ValueError names the bad quantity
        return value
