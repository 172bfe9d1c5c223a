"""The KubeRay manifests for a load cluster (deploy/kuberay/) load and say what docs/ray.md says: the Ray of the
image is the driver's, the head runs no workers and keeps the results, the load hosts get whole cores, and the
RayJob's entrypoint is a ``batchbench bench`` command batchbench's own parser accepts, from the cluster's Ray
workers against an engine URL every node reaches. They have not run on a Kubernetes cluster (no cluster here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import ray
import yaml

from batchbench.cli import parser
from batchbench.core.options import typed_options
from batchbench.load.ray_workers import _loopback, _url_host

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kuberay"


def _documents(name: str) -> dict[str, dict[str, Any]]:
    """The manifest's documents by kind."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text(encoding="utf-8")) if d]
    return {d["kind"]: d for d in docs}


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return list(template["spec"]["containers"])


def test_the_cluster_runs_the_drivers_ray_and_batchbench_on_whole_cores() -> None:
    docs = _documents("raycluster.yaml")
    cluster = docs["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"] == "batchbench-load"
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray.__version__  # the workers' Ray must be the driver's
    head, (load,) = spec["headGroupSpec"], spec["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no load-generator worker shares the driver's host
    images = {c["image"] for c in _containers(head["template"]) + _containers(load["template"])}
    assert images == {f"REGISTRY/batchbench-ray:{ray.__version__}"}
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert f"FROM rayproject/ray:{ray.__version__}-py311" in dockerfile and "[ray]" in dockerfile
    for container in _containers(head["template"]) + _containers(load["template"]):
        res = container["resources"]
        assert res["requests"] == res["limits"], container["name"]  # guaranteed QoS: nothing throttles a loop
        assert float(res["requests"]["cpu"]).is_integer(), container["name"]
    assert load["replicas"] == load["minReplicas"] == load["maxReplicas"]  # a fixed cluster while it measures
    ports = {p["name"]: p["containerPort"] for p in _containers(head["template"])[0]["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
    # The driver writes its results to the head's volume, a claim that outlives the pod.
    (mount,) = _containers(head["template"])[0]["volumeMounts"]
    (volume,) = head["template"]["spec"]["volumes"]
    assert mount["name"] == volume["name"] and mount["mountPath"] == "/results"
    assert volume["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_the_job_is_a_bench_command_batchbench_accepts_from_the_clusters_workers() -> None:
    job = _documents("rayjob.yaml")["RayJob"]
    cluster = _documents("raycluster.yaml")["RayCluster"]
    assert job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["batchbench", "bench"]
    parsed = vars(parser().parse_args(argv[1:]))
    parsed.pop("handler")
    options = typed_options(parsed.pop("options"), parsed)
    workers = options.workload.workers  # type: ignore[attr-defined]
    (load,) = cluster["spec"]["workerGroupSpecs"]
    cpus = int(load["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert workers.pool == "ray" and workers.count == load["replicas"] * cpus  # one worker a core, every core
    assert options.workload.ray_address is None  # type: ignore[attr-defined]  # the submitter's RAY_ADDRESS
    assert str(options.engine.results_dir) == "/results"  # type: ignore[attr-defined]  # the head's volume
    (url,) = re.findall(r"--engine-url \S+=(\S+)", job["spec"]["entrypoint"])
    assert not _loopback(_url_host(url)), url  # a Service every node reaches: loopback is refused on other nodes
