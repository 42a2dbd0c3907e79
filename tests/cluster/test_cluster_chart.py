"""The chart installed on a real node, and the Kubernetes provider's sandboxes as real pods.

One release for the module (installing costs seconds, a node restart more): `helm install` with
the images `.ci/images` built (pull policy Never), the small profile (`values-small.yaml`, a
2-CPU node) and Redis from the control-plane image, sandboxes in a namespace of their own. The
tests run in file order against it, each leaving the pool as it found it (warm, nothing leased):

  install    every pod Ready, the pool warm; a token minted as NOTES.txt says; through the api's
             Service a session runs print(1), numpy, bash and the file calls; `helm test --logs`
  provider   lease, exec, destroy and refill; a pod deleted out of band; a container killed on
             the node; the memory limit's OOM kill; the kubelet restarted; the API server restarted
  chart      an upgrade changing one api setting rolls the api pod and nothing else; the
             StorageClass check refuses an install that could never become Ready; uninstall leaves
             only what docs/helm.md says it keeps

What a single node with this CNI cannot show (NetworkPolicy enforcement, several nodes) is in
docs/kubernetes.md, "Testing".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_support import CHART, Cluster, Sessions, local_image, ready, restarts
from testkit import free_port, wait_for

RELEASE = "spc"
NAMESPACE = "spc"
SANDBOX_NAMESPACE = "spc-sandboxes"
NAMESPACES = (NAMESPACE, SANDBOX_NAMESPACE)
FULLNAME = f"{RELEASE}-sandpool"
WARM = 2  # values-small.yaml's pool
SANDBOX_SELECTOR = f"app.kubernetes.io/component=sandbox,sandpool.dev/installation={RELEASE}"
READY_TIMEOUT = 90.0

pytestmark = pytest.mark.timeout(300)


def install_args() -> list[str]:
    return ["-f", str(CHART / "values-small.yaml"),
            "--set", f"image.repository={local_image('image')}", "--set", "image.pullPolicy=Never",
            "--set", f"sandboxImage.repository={local_image('sandboxImage')}",
            "--set", "redis.bundled.useControlPlaneImage=true",
            # No StorageClass on this node (the check refuses the default; tested below).
            "--set", "redis.bundled.persistence.enabled=false",
            "--set", f"sandboxes.namespace={SANDBOX_NAMESPACE}", "--set", "sandboxes.createNamespace=true"]


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[Cluster]:
    for ns in NAMESPACES:  # a run killed before its teardown
        cluster.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", check=False)
        cluster.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", timeout=120)
    cluster.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", *install_args(),
                 "--wait", "--timeout", "180s")
    yield cluster
    cluster.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", check=False)
    cluster.kubectl("delete", "namespace", *NAMESPACES, "--ignore-not-found", "--wait=true", timeout=120,
                    check=False)


@pytest.fixture(scope="module")
def sessions(release: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Sessions:
    """A token minted exactly as NOTES.txt says, and the api's Service address (reached from the node)."""
    notes = release.helm("get", "notes", RELEASE, "-n", NAMESPACE).stdout
    secret = f"{FULLNAME}-signing"
    assert f"get secret {secret}" in notes and "jsonpath='{.data.ed25519\\.key}'" in notes, notes
    key = tmp_path_factory.mktemp("signing") / "sandpool-signing.key"
    key.write_bytes(release.secret_value(NAMESPACE, secret, "ed25519.key"))
    key.chmod(0o600)
    sandpool = str(Path(sys.executable).with_name("sandpool"))
    token = subprocess.run([sandpool, "token", "--workspace", "cluster-test", "--ttl", "3600", "--key", str(key),
                            "--audience", "sandpool"], capture_output=True, text=True, check=True).stdout.strip()
    service = release.get("service", "-n", NAMESPACE, f"{FULLNAME}-api")
    return Sessions(f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}", token)


def warm_pods(cluster: Cluster) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(SANDBOX_NAMESPACE, SANDBOX_SELECTOR) if ready(p)]


def wait_warm(cluster: Cluster, excluding: set[str] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """The pool back at its warm target, none of `excluding` among its pods (they are gone)."""
    def warm() -> list[dict[str, Any]] | None:
        pods = cluster.pods(SANDBOX_NAMESPACE, SANDBOX_SELECTOR)
        names = {p["metadata"]["name"] for p in pods}
        good = [p for p in pods if ready(p)]
        return good if len(good) >= WARM and not names & excluding else None
    return wait_for(warm, timeout=READY_TIMEOUT, interval=0.5, what=f"{WARM} warm sandbox pods without {excluding}",
                    state=lambda: [(p["metadata"]["name"], p["status"].get("phase"))
                                   for p in cluster.pods(SANDBOX_NAMESPACE, SANDBOX_SELECTOR)])


def pod_uids(cluster: Cluster, namespace: str, selector: str = "") -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.pods(namespace, selector)
            if p["metadata"].get("deletionTimestamp") is None}


def session_gone(http: httpx.Client, session_id: str) -> bool:
    return http.get(f"/sessions/{session_id}").status_code == 404


# --- the StorageClass check: before the install (it must not depend on one) ------------------------


def test_an_install_no_storage_class_could_serve_is_refused(cluster: Cluster) -> None:
    """Redis's claim would stay Pending forever: the install stops at once, saying what to set."""
    base = ["install", "spc-sc-check", str(CHART), "-n", "spc-sc-check", "--dry-run=server",
            "--set", f"image.repository={local_image('image')}"]
    refused = cluster.helm(*base, check=False)
    assert refused.returncode != 0
    assert "no default StorageClass" in refused.stderr and "redis.bundled.persistence.storageClass" in refused.stderr
    # A default StorageClass (or persistence off) lets the same install through.
    sc = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
          "metadata": {"name": "spc-default", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
          "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}
    manifest = Path(os.environ.get("TMPDIR", "/tmp")) / f"spc-sc-{os.getpid()}.json"
    manifest.write_text(json.dumps(sc))
    try:
        cluster.kubectl("apply", "-f", str(manifest))
        cluster.helm(*base)
    finally:
        cluster.kubectl("delete", "-f", str(manifest), "--ignore-not-found")
        manifest.unlink()
    cluster.helm(*base, "--set", "redis.bundled.persistence.enabled=false")


# --- install ------------------------------------------------------------------------------------------


def test_every_pod_is_ready_and_the_pool_warm(release: Cluster) -> None:
    control = release.pods(NAMESPACE)
    components = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in control
                        if p["metadata"].get("deletionTimestamp") is None)
    assert components == ["api", "controller", "redis"], components
    assert all(ready(p) for p in control), [(p["metadata"]["name"], p["status"].get("phase")) for p in control]
    pods = wait_warm(release)
    images = {c["image"].rsplit(":", 1)[0] for p in pods for c in p["spec"]["containers"]}
    assert images == {local_image("sandboxImage")}
    redis = release.pods(NAMESPACE, "app.kubernetes.io/component=redis")[0]
    assert redis["spec"]["containers"][0]["image"].startswith(local_image("image") + ":")


def test_a_session_through_the_service(sessions: Sessions) -> None:
    with sessions.client() as http:
        session = sessions.create(http)
        sid = session["session_id"]
        try:
            assert Sessions.content(http, sid, "print(1)")["stdout"] == "1\n"
            out = Sessions.content(http, sid, "import numpy; print(numpy.arange(4).sum())")
            assert out["stdout"] == "6\n" and out["return_code"] == 0
            bash = Sessions.content(http, sid, "echo $((6 * 7)) && python -c 'import numpy' && id -u",
                                    tool="bash_code_execution")
            assert bash["stdout"].split() == ["42", "10001"] and bash["return_code"] == 0, bash
            put = http.post(f"/sessions/{sid}/files", files={"file": ("data.csv", b"a,b\n1,2\n")},
                            data={"path": "in/data.csv"})
            assert put.status_code == 201, put.text
            summed = Sessions.content(http, sid, "import pandas as pd\n"
                                      "pd.read_csv('in/data.csv').sum(axis=1).to_csv('out.csv', index=False)")
            assert summed["return_code"] == 0, summed
            got = http.get(f"/sessions/{sid}/files", params={"path": "out.csv"})
            assert got.status_code == 200 and got.content.split() == [b"0", b"3"], got.content
        finally:
            assert http.delete(f"/sessions/{sid}").status_code == 204


def test_port_forward_as_notes_say(release: Cluster, sessions: Sessions) -> None:
    """NOTES' `kubectl port-forward svc/...`: the API server streams through the kubelet, which
    authenticates it by its client certificate (anonymous callers get 401: next test)."""
    port = free_port()
    forward = subprocess.Popen([release.kubectl_binary, "--kubeconfig", str(release.kubeconfig), "-n", NAMESPACE,
                                "port-forward", f"svc/{FULLNAME}-api", f"{port}:8080"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        forwarded = Sessions(f"http://127.0.0.1:{port}", sessions.token)
        with forwarded.client() as http:
            wait_for(lambda: _answers(http), timeout=30, interval=0.2, what="the port-forward")
            sid = forwarded.create(http)["session_id"]
            assert Sessions.content(http, sid, "print(1)")["stdout"] == "1\n"
            assert http.delete(f"/sessions/{sid}").status_code == 204
    finally:
        forward.terminate()
        forward.wait(10)
    wait_warm(release)


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def test_the_kubelet_refuses_anonymous_callers(release: Cluster) -> None:
    node = release.get("nodes")["items"][0]
    address = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    answer = httpx.get(f"https://{address}:{port}/pods", verify=False, timeout=10)
    assert answer.status_code == 401, answer.text[:200]


def test_sandboxed_code_reaches_nothing_past_the_node(sessions: Sessions) -> None:
    """No default route, no masquerade, the FORWARD drop, and the host answering pods only on DNS and
    the API relay: the gateway, the outside world and the kubelet are all out of reach."""
    code = ("import socket\n"
            "for host, port in [('1.1.1.1', 443), ('192.0.2.1', 80), ('10.85.0.1', 10250), ('10.85.0.1', 22)]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n"
            "        s.connect((host, port)); print('REACHED', host, port)\n"
            "    except OSError as e:\n"
            "        print('no', host, port, type(e).__name__)\n"
            "try:\n"
            "    print('RESOLVED', socket.gethostbyname('example.com'))\n"
            "except OSError:\n"
            "    print('no dns for example.com')\n")
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        try:
            out = Sessions.content(http, sid, code)
        finally:
            http.delete(f"/sessions/{sid}")
    assert "REACHED" not in out["stdout"] and "RESOLVED" not in out["stdout"], out
    assert out["stdout"].count("no ") == 5, out


def test_helm_test_logs(release: Cluster) -> None:
    ran = release.helm("test", RELEASE, "-n", NAMESPACE, "--logs", "--timeout", "120s", check=False)
    assert ran.returncode == 0, ran.stderr + ran.stdout
    assert "smoke test passed" in ran.stdout, ran.stdout
    wait_warm(release)


# --- the provider on real pods ----------------------------------------------------------------------


def test_lease_destroy_and_refill(release: Cluster, sessions: Sessions) -> None:
    before = {p["metadata"]["name"] for p in wait_warm(release)}
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        assert pod in before  # leased from the warm pool, not started for it
        assert http.delete(f"/sessions/{sid}").status_code == 204
    # Single use: the released sandbox's pod is deleted and the pool refilled with new ones.
    wait_warm(release, excluding={pod})


def test_a_pod_deleted_out_of_band(release: Cluster, sessions: Sessions) -> None:
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        release.kubectl("delete", "pod", "-n", SANDBOX_NAMESPACE, pod, "--grace-period=0", "--force")
        answer = wait_for(lambda: _failed_call(http, sid), timeout=30, interval=0.5,
                          what="a call to the session whose pod was deleted to fail")
        assert answer.status_code in (502, 503, 404), answer.text
        wait_for(lambda: session_gone(http, sid), timeout=30, interval=0.5, what="the session to end")
    wait_warm(release, excluding={pod})


def _failed_call(http: httpx.Client, sid: str) -> httpx.Response | None:
    answer = Sessions.run(http, sid, "print(1)")
    return answer if answer.status_code != 200 else None


def test_a_container_killed_on_the_node(release: Cluster, sessions: Sessions) -> None:
    """The sandbox's agent dies on the node (SIGKILL, as a crash or the node's OOM killer would):
    the kubelet reports the pod Failed, the session gets a clear error and ends, the pool refills."""
    release.on_this_machine()
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        status = release.get("pod", "-n", SANDBOX_NAMESPACE, pod)["status"]
        release.kill_container(status["containerStatuses"][0]["containerID"].split("//", 1)[1])
        answer = wait_for(lambda: _failed_call(http, sid), timeout=30, interval=0.5,
                          what="a call to the session whose container was killed to fail")
        assert answer.status_code in (502, 503, 404), answer.text
        if answer.status_code != 404:
            assert "sandbox" in answer.text.lower(), answer.text
        wait_for(lambda: session_gone(http, sid), timeout=30, interval=0.5, what="the session to end")
    wait_warm(release, excluding={pod})


def test_the_memory_limit(release: Cluster, sessions: Sessions) -> None:
    """Code that allocates past the pod's memory limit is OOM-killed by the kernel (the pod's cgroup
    counts the kill); the call answers that plainly (exit 137, a new interpreter), and the pod, its
    agent and the session carry on. The hog is always the one killed: sandboxed code cannot make
    its agent the OOM killer's choice (its oom_score_adj is not the code's to raise)."""
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        try:
            pod = Sessions.pod_of(http, sid)
            before = release.get("pod", "-n", SANDBOX_NAMESPACE, pod)
            limit = before["spec"]["containers"][0]["resources"]["limits"]["memory"]
            assert limit == "512Mi"
            hog = Sessions.content(http, sid, "x = bytearray(800 * 1024 * 1024)\nprint('survived')")
            assert hog["return_code"] == 137 and "survived" not in hog["stdout"], hog
            assert "interpreter exited with status 137" in hog["stderr"], hog
            kills = _oom_kills(before)
            if kills is not None:  # the node's cgroup v1 counters: the kernel's OOM killer did it
                assert kills >= 1
            aim = Sessions.content(http, sid, "open('/proc/1/oom_score_adj', 'w').write('1000')")
            assert aim["return_code"] != 0 and "PermissionError" in aim["stderr"], aim
            assert Sessions.content(http, sid, "print(2)")["stdout"] == "2\n"
            after = release.get("pod", "-n", SANDBOX_NAMESPACE, pod)
            assert after["metadata"]["uid"] == before["metadata"]["uid"] and restarts(after) == 0 and ready(after)
        finally:
            http.delete(f"/sessions/{sid}")
    wait_warm(release)


def _oom_kills(pod: dict[str, Any]) -> int | None:
    """OOM kills counted in the pod's memory cgroups on this node (cgroup v1, the kubelet's cgroupfs
    layout: kubepods/<qos>/pod<uid>/<container>), or None where that layout is not found."""
    qos = pod["status"].get("qosClass", "").lower()
    for base in (Path("/sys/fs/cgroup/memory/kubepods") / qos / f"pod{pod['metadata']['uid']}",
                 Path("/sys/fs/cgroup/memory/kubepods") / f"pod{pod['metadata']['uid']}"):
        if base.is_dir():
            total = 0
            for control in base.rglob("memory.oom_control"):
                for line in control.read_text().splitlines():
                    if line.startswith("oom_kill "):
                        total += int(line.split()[1])
            return total
    return None


def test_the_kubelet_restarted(release: Cluster, sessions: Sessions) -> None:
    """Pods outlive their kubelet: a leased session runs through the restart, no pod restarts, and
    the restarted kubelet starts the refill."""
    release.on_this_machine()
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        uids = pod_uids(release, SANDBOX_NAMESPACE) | pod_uids(release, NAMESPACE)
        release.restart("kubelet")
        assert Sessions.content(http, sid, "print(3)")["stdout"] == "3\n"
        still = pod_uids(release, SANDBOX_NAMESPACE) | pod_uids(release, NAMESPACE)
        assert {n: u for n, u in still.items() if n in uids} == uids
        assert all(restarts(p) == 0 for p in release.pods(NAMESPACE) + release.pods(SANDBOX_NAMESPACE))
        assert http.delete(f"/sessions/{sid}").status_code == 204
    wait_warm(release, excluding={pod})


def test_the_api_server_restarted(release: Cluster, sessions: Sessions) -> None:
    """Sessions never need the Kubernetes API: calls run while it is down. Once it is back the
    controller's watch resumes: a released sandbox is deleted and its replacement started."""
    release.on_this_machine()
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        restarting = threading.Thread(target=release.restart, args=("kube-apiserver",))
        restarting.start()
        answers = []
        while restarting.is_alive():
            answers.append(Sessions.run(http, sid, "print(4)").status_code)
            time.sleep(0.2)
        restarting.join()
        assert answers and set(answers) == {200}, answers
        assert http.delete(f"/sessions/{sid}").status_code == 204
    wait_warm(release, excluding={pod})


def test_the_controller_killed(release: Cluster, sessions: Sessions) -> None:
    """The controller's container SIGKILLed on the node: the kubelet restarts it; a leased session
    runs on meanwhile (the api never needs the controller), the new controller adopts the pods it
    finds (none is replaced) and keeps the pool: a released sandbox is destroyed and refilled.
    (The kill waits for the lease's refill to be Ready: a pod still starting when its controller
    dies is destroyed and replaced by the next one, which cannot know whether the create finished.)"""
    release.on_this_machine()
    wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        pod = Sessions.pod_of(http, sid)
        wait_for(lambda: _at_rest(release, leased=1), timeout=READY_TIMEOUT, interval=0.5,
                 what=f"{WARM} warm pods and the leased one, all Ready")
        sandboxes = pod_uids(release, SANDBOX_NAMESPACE)
        controller = release.pods(NAMESPACE, "app.kubernetes.io/component=controller")[0]
        name = controller["metadata"]["name"]
        release.kill_container(controller["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1])
        assert Sessions.content(http, sid, "print(5)")["stdout"] == "5\n"
        wait_for(lambda: (p := release.get("pod", "-n", NAMESPACE, name)) and restarts(p) == 1 and ready(p),
                 timeout=READY_TIMEOUT, interval=0.5, what="the controller restarted and Ready")
        assert {n: u for n, u in pod_uids(release, SANDBOX_NAMESPACE).items() if n in sandboxes} == sandboxes
        assert Sessions.content(http, sid, "print(6)")["stdout"] == "6\n"
        assert http.delete(f"/sessions/{sid}").status_code == 204
    wait_warm(release, excluding={pod})


NETWORK_POLICY_ENV = "SANDPOOL_TEST_NETWORK_POLICY_ENFORCED"


def test_network_policies_confine_sandboxes(release: Cluster, sessions: Sessions) -> None:
    """From a session: Redis, the api, the controller, the Kubernetes API and another sandbox's agent
    are all out of reach (the chart's NetworkPolicies). Only on a cluster whose CNI enforces them:
    .ci/cluster's bridge does not, so here the policies are validated by the API server, not enforced
    (docs/kubernetes.md, "Testing", says how to run this where they are)."""
    if os.environ.get(NETWORK_POLICY_ENV) != "1":
        pytest.skip(f"this cluster's CNI enforces no NetworkPolicy (.ci/cluster's bridge does not): set "
                    f"{NETWORK_POLICY_ENV}=1 on a cluster whose CNI does (docs/kubernetes.md)")
    targets = [(release.get("service", "-n", NAMESPACE, f"{FULLNAME}-{name}")["spec"]["clusterIP"], port)
               for name, port in (("redis", 6379), ("api", 8080), ("controller", 8081))]
    targets.append((release.get("service", "-n", "default", "kubernetes")["spec"]["clusterIP"], 443))
    pods = wait_warm(release)
    with sessions.client() as http:
        sid = sessions.create(http)["session_id"]
        try:
            mine = Sessions.pod_of(http, sid)
            other = next(p for p in pods if p["metadata"]["name"] != mine)
            targets.append((other["status"]["podIP"], other["spec"]["containers"][0]["ports"][0]["containerPort"]))
            code = ("import socket\n"
                    f"for host, port in {targets!r}:\n"
                    "    s = socket.socket(); s.settimeout(3)\n"
                    "    try:\n"
                    "        s.connect((host, port)); print('REACHED', host, port)\n"
                    "    except OSError as e:\n"
                    "        print('no', host, port, type(e).__name__)\n")
            out = Sessions.content(http, sid, code)
        finally:
            http.delete(f"/sessions/{sid}")
    assert "REACHED" not in out["stdout"] and out["stdout"].count("no ") == len(targets), out


# --- the chart: upgrade and uninstall ---------------------------------------------------------------


def test_an_upgrade_rolls_exactly_the_pods_whose_configuration_changed(release: Cluster,
                                                                       sessions: Sessions) -> None:
    """An api flag changes the api's pod template alone: the api rolls; the controller, Redis and
    the sandboxes keep their pods (and so every warm sandbox and Redis's state)."""
    # The pool at rest first: exactly its warm pods (a surplus from the controller's restart above
    # is the controller's to retire, at its next reconciliation, not the upgrade's doing).
    wait_for(lambda: _at_rest(release), timeout=READY_TIMEOUT, interval=0.5, what=f"exactly {WARM} warm pods",
             state=lambda: [(p["metadata"]["name"], p["status"].get("phase"), ready(p))
                            for p in release.pods(SANDBOX_NAMESPACE, SANDBOX_SELECTOR)])
    api_before = pod_uids(release, NAMESPACE, "app.kubernetes.io/component=api")
    others_before = (pod_uids(release, NAMESPACE, "app.kubernetes.io/component in (controller,redis)")
                     | pod_uids(release, SANDBOX_NAMESPACE))
    release.helm("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *install_args(),
                 "--set", "api.extraArgs={--max-lifetime-seconds=1800}", "--wait", "--timeout", "120s")
    api_after = wait_for(lambda: _settled(release, "app.kubernetes.io/component=api"), timeout=READY_TIMEOUT,
                         interval=0.5, what="the api's rollout to settle")
    assert not set(api_after.values()) & set(api_before.values()), (api_before, api_after)
    others_after = (pod_uids(release, NAMESPACE, "app.kubernetes.io/component in (controller,redis)")
                    | pod_uids(release, SANDBOX_NAMESPACE))
    assert others_after == others_before
    with sessions.client() as http:
        session = sessions.create(http)
        assert session["max_lifetime_seconds"] == 1800  # the new setting is the one in force
        assert http.delete(f"/sessions/{session['session_id']}").status_code == 204
    wait_warm(release)


def _at_rest(cluster: Cluster, leased: int = 0) -> bool:
    """Exactly the pool's warm pods and `leased` more, every one Ready: nothing starting or going."""
    pods = cluster.pods(SANDBOX_NAMESPACE, SANDBOX_SELECTOR)
    return len(pods) == WARM + leased and all(ready(p) for p in pods)


def _settled(cluster: Cluster, selector: str) -> dict[str, str] | None:
    pods = cluster.pods(NAMESPACE, selector)
    return pod_uids(cluster, NAMESPACE, selector) if pods and all(ready(p) for p in pods) else None


def test_uninstall_leaves_only_what_the_docs_say_is_kept(release: Cluster) -> None:
    """docs/helm.md ("Upgrades"): the signing-key Secret and the last `helm test` pod stay; the
    sandbox namespace (created by the release) goes with every sandbox pod in it."""
    tested = release.kubectl("get", "pod", "-n", NAMESPACE, f"{FULLNAME}-test", check=False).returncode == 0
    release.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s")
    wait_for(lambda: release.kubectl("get", "namespace", SANDBOX_NAMESPACE, check=False).returncode != 0,
             timeout=READY_TIMEOUT, interval=0.5, what=f"namespace {SANDBOX_NAMESPACE} to go")
    kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,poddisruptionbudgets,pvc"

    def left() -> set[str]:
        items = release.get(kinds, "-n", NAMESPACE)["items"]
        return {f"{o['kind']}/{o['metadata']['name']}" for o in items
                if o["metadata"].get("deletionTimestamp") is None
                and o["metadata"]["name"] not in ("kube-root-ca.crt", "openshift-service-ca.crt", "default")}

    expected = {f"Secret/{FULLNAME}-signing"} | ({f"Pod/{FULLNAME}-test"} if tested else set())
    wait_for(lambda: left() == expected, timeout=60, interval=0.5, what="only the kept objects",
             state=left)
