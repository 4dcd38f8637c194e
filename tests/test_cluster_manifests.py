"""cluster/: the KubeRay manifest (its ComputeDomains and RayCluster) and the runtime env, checked
against the CRD schemas vendored in cluster/schemas/ and against what the placement code reads."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from autotune.engine.placement import NVLINK_DOMAIN_LABEL

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
SCHEMAS = CLUSTER / "schemas"
GPUS_PER_POD = 4
RDMA = "rdma/rdma_shared_device_a"  # NVIDIA Network Operator's RDMA shared device plugin (see the manifest)
# libyaml reads the 0.9 MB RayCluster CRD in ~0.1 s, pure Python in ~1 s.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def manifest() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((CLUSTER / "gb200_raycluster.yaml").read_text()) if doc is not None]


def raycluster(docs: list[dict] | None = None) -> dict:
    """The manifest's one RayCluster (of ``docs``, a copy being broken, when given)."""
    (cluster,) = [doc for doc in (manifest() if docs is None else docs) if doc["kind"] == "RayCluster"]
    return cluster


def compute_domains(docs: list[dict] | None = None) -> list[dict]:
    return [doc for doc in (manifest() if docs is None else docs) if doc["kind"] == "ComputeDomain"]


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


# -- The schemas: each vendored CRD's openAPIV3Schema, checked two ways. ------------------------
# 1. Its value rules (types, enums, required, patterns) with jsonschema. A CRD schema is OpenAPI
#    v3.0 "structural" schema, JSON Schema draft 4 but for Kubernetes' extensions: `nullable`,
#    `x-kubernetes-int-or-string` (an integer or a string) and the other `x-kubernetes-*` keys,
#    which say nothing about values (list types, CEL rules: not checked here) and are dropped.
# 2. Its fields, as `kubectl apply --validate=strict` would: the API server prunes a field the
#    schema does not declare, so a misspelt one would vanish without a word. Every field must be
#    in its object's `properties` (or be a value of an `additionalProperties` map), unless
#    `x-kubernetes-preserve-unknown-fields` keeps unknown ones; an object's own `metadata` is an
#    ObjectMeta (the CRD leaves it to the API server), checked against ObjectMeta's fields.

OBJECT_META = {  # k8s.io/apimachinery ObjectMeta, the fields a manifest may set
    "name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences",
    "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
    "deletionGracePeriodSeconds", "managedFields", "selfLink",
}
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, for every version of every CRD in cluster/schemas/."""
    schemas = {}
    for path in sorted(SCHEMAS.rglob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=LOADER):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for version in crd["spec"]["versions"]:
                    schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def json_schema(node: dict) -> dict:
    """A structural schema node as JSON Schema (draft 4): Kubernetes' extensions made plain."""
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS:
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS:
            out[key] = [json_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = json_schema(value)
        elif key != "nullable" and not key.startswith("x-kubernetes-"):
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@functools.cache
def validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(json_schema(crd_schemas()[(api_version, kind)]))


def _child(path: str, key: str) -> str:
    """`path`.`key` written as jsonschema's `json_path` writes it."""
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", key) else f"{path}[{key!r}]"


def unknown_fields(value: object, node: dict, path: str = "$", is_object: bool = True) -> list[str]:
    """The fields of `value` that `node` does not declare, each named by its path."""
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [e for i, item in enumerate(value) for e in unknown_fields(item, node["items"], f"{path}[{i}]", False)]
    if not isinstance(value, dict):
        return []
    errors = []
    declared, values = node.get("properties") or {}, node.get("additionalProperties")
    keeps_unknown = node.get("x-kubernetes-preserve-unknown-fields", False)
    for key, item in value.items():
        where = _child(path, key)
        if key in declared:
            if is_object and key == "metadata" and not declared[key].get("properties"):
                errors += [f"{_child(where, field)}: unknown field {field!r} (not in ObjectMeta)"
                           for field in item if field not in OBJECT_META]
            else:
                embedded = declared[key].get("x-kubernetes-embedded-resource", False)
                errors += unknown_fields(item, declared[key], where, embedded)
        elif isinstance(values, dict):
            errors += unknown_fields(item, values, where, False)
        elif not keeps_unknown and values is not True:
            errors.append(f"{where}: unknown field {key!r} (the schema declares {sorted(declared) or 'none'})")
    return errors


def schema_errors(doc: dict) -> list[str]:
    """Why the API server would refuse `doc` (or silently drop part of it); empty when it would not."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in crd_schemas():
        return [f"$: no schema vendored in cluster/schemas/ for apiVersion {key[0]!r} kind {key[1]!r}"]
    errors = [f"{e.json_path}: {e.message}" for e in validator(*key).iter_errors(doc)]
    return errors + unknown_fields(doc, crd_schemas()[key])


def test_vendored_schemas_cover_the_manifest_and_are_json_schema() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in manifest()}
    assert kinds == {("ray.io/v1", "RayCluster"), ("resource.nvidia.com/v1beta1", "ComputeDomain")}
    for key in kinds:
        jsonschema.Draft4Validator.check_schema(validator(*key).schema)


def test_every_document_validates_against_its_crd_schema() -> None:
    for doc in manifest():
        assert schema_errors(doc) == [], doc["metadata"]["name"]


def _worker_pod(docs: list[dict]) -> dict:
    return raycluster(docs)["spec"]["workerGroupSpecs"][1]["template"]["spec"]


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


# What goes wrong -> (how, the path its error must name). The value rules alone miss the first
# four, the misspellings of optional fields: only the strict field walk catches them.
BREAKAGES = {
    "misspelt pod claim field": (
        lambda docs: _rename(_worker_pod(docs)["resourceClaims"][0], "resourceClaimTemplateName",
                             "resourceClaimTemplateNam"),
        "$.spec.workerGroupSpecs[1].template.spec.resourceClaims[0].resourceClaimTemplateNam"),
    "misspelt container claims": (
        lambda docs: _rename(_worker_pod(docs)["containers"][0]["resources"], "claims", "claim"),
        "$.spec.workerGroupSpecs[1].template.spec.containers[0].resources.claim"),
    "misspelt metadata field": (
        lambda docs: _rename(compute_domains(docs)[0]["metadata"], "labels", "label"),
        "$.metadata.label"),
    "misspelt ComputeDomain channel field": (
        lambda docs: _rename(compute_domains(docs)[0]["spec"]["channel"], "resourceClaimTemplate",
                             "resourceClaimTemplates"),
        "$.spec.channel.resourceClaimTemplates"),
    "numNodes as a string": (
        lambda docs: compute_domains(docs)[0]["spec"].update(numNodes="18"),
        "$.spec.numNodes"),
    "replicas as a string": (
        lambda docs: raycluster(docs)["spec"]["workerGroupSpecs"][0].update(replicas="18"),
        "$.spec.workerGroupSpecs[0].replicas"),
    "GPU count not a quantity": (
        lambda docs: _worker_pod(docs)["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": [4]}),
        "$.spec.workerGroupSpecs[1].template.spec.containers[0].resources.limits['nvidia.com/gpu']"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_validator_rejects_a_misspelt_field_or_a_wrong_type_naming_its_path(breakage: str) -> None:
    break_it, path = BREAKAGES[breakage]
    docs = copy.deepcopy(manifest())
    break_it(docs)
    errors = [e for doc in docs for e in schema_errors(doc)]
    assert any(e.startswith(f"{path}: ") for e in errors), errors


def test_raycluster_has_its_required_fields() -> None:
    cluster = raycluster()
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert cluster["metadata"]["name"]
    spec = cluster["spec"]
    major, minor, _ = map(int, spec["rayVersion"].split("."))
    assert (major, minor) >= (2, 52)  # token authentication
    assert spec["authOptions"] == {"mode": "token"}
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        assert group["rayStartParams"] is not None and containers(group)
        for container in containers(group):
            assert container["image"] and container["resources"]["limits"] == container["resources"]["requests"]


def test_the_head_holds_no_gpu_and_listens_on_loopback() -> None:
    head = raycluster()["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in containers(head))


def test_gpu_groups_are_racks_labelled_as_placement_reads() -> None:
    groups = raycluster()["spec"]["workerGroupSpecs"]
    domains = []
    for group in groups:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] > 0
        assert int(group["rayStartParams"]["num-gpus"]) == GPUS_PER_POD
        assert all(c["resources"]["limits"]["nvidia.com/gpu"] == GPUS_PER_POD for c in containers(group))
        domain = group["labels"][NVLINK_DOMAIN_LABEL]
        assert group["template"]["spec"]["nodeSelector"][NVLINK_DOMAIN_LABEL] == domain  # the pods sit in the rack
        domains.append(domain)
        assert group["replicas"] * GPUS_PER_POD <= 72  # an NVL72 rack's NVLink domain
    assert len(set(domains)) == len(domains) >= 2


def test_every_pod_mounts_the_shared_volume_where_the_cache_points() -> None:
    spec = raycluster()["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in group["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
        for container in containers(group):
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            cache = {e["name"]: e["value"] for e in container["env"]}["AUTOTUNE_CACHE"]
            assert any(cache.startswith(mounts[name]) for name in claims)


def test_one_compute_domain_per_rack_and_each_rack_group_claims_its_channel() -> None:
    cluster, domains = raycluster(), compute_domains()
    groups = cluster["spec"]["workerGroupSpecs"]
    assert all(d["metadata"].get("namespace") == cluster["metadata"].get("namespace") for d in domains)
    by_template = {d["spec"]["channel"]["resourceClaimTemplate"]["name"]: d for d in domains}
    assert len(by_template) == len(domains) == len(groups)  # one channel template per ComputeDomain, one per rack
    bound = []
    for group in groups:
        rack, pod = group["labels"][NVLINK_DOMAIN_LABEL], group["template"]["spec"]
        channels = [c for c in pod.get("resourceClaims", []) if c.get("resourceClaimTemplateName") in by_template]
        assert len(channels) == 1, f"{group['groupName']} claims {len(channels)} ComputeDomain channels"
        domain = by_template[channels[0]["resourceClaimTemplateName"]]
        assert domain["metadata"]["labels"][NVLINK_DOMAIN_LABEL] == rack  # the rack's own ComputeDomain
        assert domain["metadata"]["name"] == f"{cluster['metadata']['name']}-{rack}"
        assert domain["spec"]["numNodes"] == group["replicas"]  # one IMEX daemon per tray, one pod per tray
        assert domain["spec"].get("channel", {}).get("allocationMode", "Single") == "Single"
        pod_claims = {c["name"] for c in pod["resourceClaims"]}
        for container in containers(group):
            used = {c["name"] for c in container["resources"].get("claims", [])}
            assert channels[0]["name"] in used and used <= pod_claims  # a container names only its pod's claims
        bound.append(domain["metadata"]["name"])
    assert sorted(bound) == sorted(d["metadata"]["name"] for d in domains)  # each ComputeDomain to one group


def test_workers_get_the_rdma_nics_and_the_head_claims_nothing() -> None:
    spec = raycluster()["spec"]
    for group in spec["workerGroupSpecs"]:
        for container in containers(group):
            assert container["resources"]["limits"][RDMA] == container["resources"]["requests"][RDMA] == 1
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    head = spec["headGroupSpec"]
    assert "resourceClaims" not in head["template"]["spec"]
    for container in containers(head):
        assert "claims" not in container["resources"]
        assert not any(name.startswith("rdma/") for name in container["resources"]["limits"])


def test_runtime_env_leaves_data_outputs_and_environments_behind() -> None:
    env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert set(env) <= {"excludes", "env_vars", "working_dir", "pip", "py_modules"}
    for path in ("runs/", "bench/data/", ".venv/", ".git/"):
        assert path in env["excludes"]
    ignored = (CLUSTER.parent / ".rayignore").read_text().split()
    assert {"runs/", "bench/data/", ".venv/"} <= set(ignored)
