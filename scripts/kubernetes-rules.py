#!/usr/bin/env python3
"""The deployment rules the Kubernetes manifests must keep, beyond the API schemas.

Usage: kubernetes-rules.py VERSION FILE...   (run by scripts/check-kubernetes, which also
feeds it broken copies and requires each to be refused). Exits 1 naming every broken rule.

For every workload (StatefulSet, Deployment, DaemonSet) and its pod template:
- image: pinned to zerolayer:VERSION (or VERSION-cuda), never :latest or untagged;
- models: /models is a volume (a PVC), read-only, never part of the image;
- identity: the TLS volume is cert-manager's CSI driver, its certificate naming the pod
  (${POD_NAME}); no pod mounts a Secret holding a key (no CA key in any pod), and no
  Secret of ours carries a CA key or a private key;
- probes: a startup probe allowing at least 5 minutes, and readiness and liveness probes;
- admin key: ZEROLAYER_ADMIN_KEY comes from a Secret, and the preStop hook drains the pod;
- securityContext: non-root, a read-only root filesystem, every capability dropped, no
  privilege escalation;
- resources: CPU requested and limited alike, memory limited, and the cluster.toml in the
  ConfigMap sets each worker's `threads` to the CPU limit;
- a PodDisruptionBudget selects the workload's pods;
- across the files: one workload is a GPU variant (an nvidia.com/gpu limit and `cuda:0`
  workers).
"""
import re
import sys

import yaml

WORKLOADS = {"StatefulSet", "Deployment", "DaemonSet"}


def cpu_count(v):
    v = str(v)
    return int(v[:-1]) / 1000 if v.endswith("m") else float(v)


def check_pod(name, spec, config_toml, version, errors):
    def err(msg):
        errors.append(f"{name}: {msg}")

    pod_sc = spec.get("securityContext", {})
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for v in volumes.values():
        if "secret" in v:
            err(f"volume {v['name']} mounts a Secret (keys belong in a CSI volume issued per pod)")
    for c in spec.get("containers", []):
        cname = f"container {c['name']}"
        image = c.get("image", "")
        if not re.fullmatch(rf"zerolayer:{re.escape(version)}(-cuda)?", image):
            err(f"{cname}: image {image!r} is not pinned to zerolayer:{version}")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        models = mounts.get("/models")
        if not models or "persistentVolumeClaim" not in volumes.get(models["name"], {}) or not models.get("readOnly"):
            err(f"{cname}: /models is not a read-only PVC volume")
        tls = [volumes.get(m["name"], {}) for m in mounts.values()]
        csi = [v["csi"] for v in tls if v.get("csi", {}).get("driver") == "csi.cert-manager.io"]
        if not csi or "${POD_NAME}" not in csi[0].get("volumeAttributes", {}).get("csi.cert-manager.io/dns-names", ""):
            err(f"{cname}: no per-pod certificate (a csi.cert-manager.io volume naming ${{POD_NAME}})")
        startup = c.get("startupProbe")
        if not startup or startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) < 300:
            err(f"{cname}: no startup probe allowing 5 minutes for the model to load")
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in c:
                err(f"{cname}: no {probe}")
        env = {e["name"]: e for e in c.get("env", [])}
        if "secretKeyRef" not in env.get("ZEROLAYER_ADMIN_KEY", {}).get("valueFrom", {}):
            err(f"{cname}: ZEROLAYER_ADMIN_KEY does not come from a Secret")
        pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if "drain" not in pre or "--self" not in pre:
            err(f"{cname}: the preStop hook does not drain the pod")
        sc = {**pod_sc, **c.get("securityContext", {})}
        if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
            err(f"{cname}: may run as root")
        if not sc.get("readOnlyRootFilesystem"):
            err(f"{cname}: the root filesystem is writable")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("allowPrivilegeEscalation", True):
            err(f"{cname}: capabilities are not all dropped, or privileges can escalate")
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        if "cpu" not in req or "cpu" not in lim or "memory" not in lim:
            err(f"{cname}: CPU requests and limits, and a memory limit, are required")
            continue
        threads = [int(t) for t in re.findall(r"^\s*threads\s*=\s*(\d+)", config_toml, re.M)]
        workers = len(re.findall(r"^\s*\[\[nodes\.workers\]\]", config_toml, re.M))
        if len(threads) != workers or any(t != cpu_count(lim["cpu"]) for t in threads):
            err(f"{cname}: each worker's threads ({threads}) must match the CPU limit ({lim['cpu']})")
    return any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in spec.get("containers", [])) and 'device = "cuda:0"' in config_toml


def main():
    version, files = sys.argv[1], sys.argv[2:]
    errors, gpu = [], False
    for f in files:
        docs = [d for d in yaml.safe_load_all(open(f)) if d]
        configs = {d["metadata"]["name"]: d.get("data", {}).get("cluster.toml", "") for d in docs if d["kind"] == "ConfigMap"}
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        for d in docs:
            if d["kind"] == "Secret":
                data = {**d.get("data", {}), **d.get("stringData", {})}
                if any(k.endswith(".key") or k in ("tls.key", "ca.key") for k in data):
                    errors.append(f"{f}: Secret {d['metadata']['name']} carries a private key")
            if d["kind"] not in WORKLOADS:
                continue
            name = f"{f}: {d['kind']} {d['metadata']['name']}"
            spec = d["spec"]["template"]["spec"]
            cfg_names = [v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v]
            config_toml = "".join(configs.get(n, "") for n in cfg_names)
            gpu |= check_pod(name, spec, config_toml, version, errors)
            labels = d["spec"]["template"]["metadata"].get("labels", {})
            if not any(all(labels.get(k) == v for k, v in p["spec"]["selector"].get("matchLabels", {}).items()) for p in pdbs):
                errors.append(f"{name}: no PodDisruptionBudget selects its pods")
    if not gpu:
        errors.append("no GPU variant: a workload with an nvidia.com/gpu limit and cuda:0 workers")
    for e in errors:
        print(f"kubernetes-rules: {e}", file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
