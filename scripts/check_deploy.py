#!/usr/bin/env python3
"""Offline checks of deploy/ (run by scripts/check-deploy.sh, which installs the pinned tools).

1. Renders the kustomization with `kubectl kustomize`: the base and each component of
   deploy/components (and all of them together), each from an overlay under target/.
2. Checks what a first `kubectl apply -k` depends on: the Namespace is the first object; the
   DaemonSet names the generated (hash-suffixed) ConfigMap; the privilege split (base:
   privileged, Bidirectional only on the allocations directory; components/unprivileged: neither,
   capabilities dropped, ledger tmpfs off).
3. Validates every rendered object, deploy/examples, examples/ and deploy/tests against the
   Kubernetes schemas (kubernetes-validate --strict); a custom resource (the ServiceMonitor)
   against its CRD's schema through scripts/validate-crds.mjs.
4. Evaluates the ValidatingAdmissionPolicies of deploy/tenant-policy.yaml with cel-python
   against deploy/tests/tenant-policy-cases.yaml, and checks that each validation is needed:
   dropping any one must let at least one refused case through.

Ends with "N passed, N failed".
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPONENTS = sorted(p.name for p in (DEPLOY / "components").iterdir() if p.is_dir())
K8S_VERSION = "1.37.0"
TEST_PREFIX = "cuvisor.test/"

passed = 0
failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {what}")
    else:
        failed += 1
        print(f"FAIL {what}")


def render(kubectl, out, name, components):
    d = out / "overlays" / name
    d.mkdir(parents=True, exist_ok=True)
    rel = Path("../../../..") / "deploy"  # out = target/deploy-check
    k = {"resources": [str(rel)], "components": [str(rel / "components" / c) for c in components]}
    (d / "kustomization.yaml").write_text(yaml.safe_dump(k))
    text = subprocess.run([kubectl, "kustomize", str(d)], check=True, capture_output=True,
                          text=True).stdout
    path = out / f"{name}.yaml"
    path.write_text(text)
    return path, [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs, kind, name=None):
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return hits[0] if len(hits) == 1 else None


def check_variant(name, components, docs):
    check(docs[0]["kind"] == "Namespace", f"{name}: the Namespace is the first object")
    ds = find(docs, "DaemonSet", "cuvisor-device-plugin")
    cm = find(docs, "ConfigMap")
    if ds is None or cm is None:
        check(False, f"{name}: one DaemonSet and one ConfigMap")
        return
    spec = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    check(vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
          and cm["metadata"]["name"].startswith("cuvisor-device-plugin-"),
          f"{name}: the DaemonSet names the hash-suffixed ConfigMap {cm['metadata']['name']}")
    check(all(v.get("hostPath", {}).get("path") != "/dev" for v in vols.values()),
          f"{name}: no /dev hostPath")
    (c,) = spec["containers"]
    sc = c["securityContext"]
    bidir = [m["mountPath"] for m in c["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    ledger = next(l for l in cm["data"]["config.toml"].splitlines() if l.startswith("mount = "))
    if "unprivileged" in components:
        check(not sc.get("privileged") and sc["capabilities"]["drop"] == ["ALL"]
              and sc.get("allowPrivilegeEscalation") is False and not bidir
              and ledger == 'mount = "none"',
              f"{name}: not privileged, capabilities dropped, no Bidirectional, ledger tmpfs off")
    else:
        check(sc.get("privileged") is True and bidir == ["/var/lib/cuvisor/allocations"]
              and ledger == 'mount = "tmpfs"',
              f"{name}: privileged for Bidirectional on the allocations directory only")
    check(sc.get("readOnlyRootFilesystem") is True, f"{name}: read-only root file system")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(env.get("NVIDIA_VISIBLE_DEVICES") == "all" and "utility" in env.get("NVIDIA_DRIVER_CAPABILITIES", ""),
          f"{name}: the toolkit is asked for NVML (NVIDIA_VISIBLE_DEVICES=all, utility)")
    live, ready = c["livenessProbe"]["exec"]["command"], c["readinessProbe"]["exec"]["command"]
    check(live[1:2] == ["probe"] and "--ready" not in live and ready == live + ["--ready"],
          f"{name}: exec probes from the plugin's own state (probe, probe --ready)")
    check(not spec.get("initContainers") and not spec.get("hostPID") and not spec.get("hostNetwork"),
          f"{name}: no init container, no host pid or network namespace")
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    off_operator = {"key": "nvidia.com/gpu.deploy.device-plugin", "operator": "NotIn", "values": ["true"]}
    check(len(terms) == 3 and all(off_operator in t["matchExpressions"] for t in terms),
          f"{name}: every node-affinity term keeps off nodes where the GPU Operator runs its device plugin")
    cdi_dirs = {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}
    check(cdi_dirs.get("/var/run/cdi") is False and cdi_dirs.get("/etc/cdi") is True,
          f"{name}: /var/run/cdi read-write (cuvisor's specs), /etc/cdi read-only (NVIDIA's, checked)")
    has_rc = "runtimeClassName" in spec
    check(has_rc == ("default-runtime" not in components),
          f"{name}: runtimeClassName {'nvidia' if has_rc else 'absent'}")


# --- the admission policies, evaluated ---------------------------------------------------------

def load_cel():
    import celpy
    from celpy import celtypes
    return celpy, celtypes


def selector_matches(sel, labels):
    if not sel:
        return True
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def rule_matches(rules, group, version, resource, subresource, operation):
    full = resource + ("/" + subresource if subresource else "")
    for r in rules:
        if (group in r["apiGroups"] or "*" in r["apiGroups"]) \
                and (version in r["apiVersions"] or "*" in r["apiVersions"]) \
                and (operation in r["operations"] or "*" in r["operations"]) \
                and full in r["resources"]:
            return True
    return False


class Policy:
    def __init__(self, doc, celpy, celtypes):
        self.name = doc["metadata"]["name"]
        self.spec = doc["spec"]
        self.env = celpy.Environment()
        self.celpy, self.celtypes = celpy, celtypes
        self.variables = [(v["name"], self.compile(v["expression"])) for v in self.spec.get("variables", [])]
        self.validations = [(self.compile(v["expression"]), v["message"]) for v in self.spec["validations"]]

    def compile(self, expr):
        return self.env.program(self.env.compile(expr))

    def refusals(self, obj, skip=None):
        """The messages of the validations that refuse obj (an error refuses: failurePolicy Fail)."""
        ct = self.celtypes
        variables = ct.MapType({})
        act = {"object": self.celpy.json_to_cel(obj), "variables": variables}
        try:
            for name, prg in self.variables:
                variables[ct.StringType(name)] = prg.evaluate(act)
        except Exception as e:  # noqa: BLE001 - any evaluation error refuses
            return [f"variable error: {e}"]
        out = []
        for i, (prg, message) in enumerate(self.validations):
            if i == skip:
                continue
            try:
                r = prg.evaluate(act)
            except Exception as e:  # noqa: BLE001
                out.append(f"evaluation error: {e}")
                continue
            if isinstance(r, Exception) or not isinstance(r, ct.BoolType):
                out.append(f"not a bool: {r!r}")
            elif not bool(r):
                out.append(" ".join(message.split()))
        return out


def request_of(case):
    meta = case["metadata"]
    ann = meta.get("annotations") or {}
    test = {k[len(TEST_PREFIX):]: v for k, v in ann.items() if k.startswith(TEST_PREFIX)}
    obj = json.loads(json.dumps(case))
    obj["metadata"]["annotations"] = {k: v for k, v in ann.items() if not k.startswith(TEST_PREFIX)}
    if not obj["metadata"]["annotations"]:
        del obj["metadata"]["annotations"]
    ns = meta["namespace"]
    labels = {"kubernetes.io/metadata.name": ns}
    for kv in filter(None, (test.get("namespace-labels") or "").split(",")):
        k, v = kv.split("=", 1)
        labels[k] = v
    resource = {"Pod": "pods", "ConfigMap": "configmaps", "Secret": "secrets"}[case["kind"]]
    return obj, labels, resource, test.get("subresource", ""), test.get("operation", "CREATE"), test["expect"]


def decide(policies, bindings, req, skip=None):
    obj, labels, resource, sub, op, _ = req
    out = []
    for b in bindings:
        p = policies[b["spec"]["policyName"]]
        if not rule_matches(p.spec["matchConstraints"]["resourceRules"], "", "v1", resource, sub, op):
            continue
        if not selector_matches(b["spec"].get("matchResources", {}).get("namespaceSelector"), labels):
            continue
        assert b["spec"]["validationActions"] == ["Deny"], b["spec"]["validationActions"]
        out += p.refusals(obj, skip=skip[1] if skip and skip[0] == p.name else None)
    return out


def check_policy(docs):
    celpy, celtypes = load_cel()
    policies = {d["metadata"]["name"]: Policy(d, celpy, celtypes)
                for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    check(len(policies) == 2 and len(bindings) == 2, "two policies, each bound")
    env_lists = {json.dumps(sorted(eval_list(p, "forbiddenEnv"))) for p in policies.values()}
    check(len(env_lists) == 1, "both policies forbid the same environment names")
    cases = [c for c in yaml.safe_load_all((DEPLOY / "tests" / "tenant-policy-cases.yaml").read_text()) if c]
    reqs = []
    for case in cases:
        req = request_of(case)
        reqs.append((case["metadata"]["name"], req))
        refused = decide(policies, bindings, req)
        expect = req[5]
        what = f"policy: {case['kind']} {req[0]['metadata']['namespace']}/{case['metadata']['name']}"
        if expect == "allow":
            check(not refused, f"{what} admitted" + (f" (refused: {refused})" if refused else ""))
        else:
            words = expect.split(":", 1)[1].strip()
            check(len(refused) == 1 and words in refused[0],
                  f"{what} refused for \"{words}\"" + ("" if len(refused) == 1 and words in refused[0]
                                                        else f" (got: {refused})"))
    # Every validation is needed: without it, some case that must be refused is admitted.
    for p in policies.values():
        for i, (_, message) in enumerate(p.validations):
            let_through = [n for n, r in reqs if r[5] != "allow" and not decide(policies, bindings, r, skip=(p.name, i))]
            check(bool(let_through), f"policy {p.name} validation {i} is needed"
                  + (f" (without it {', '.join(let_through)} would be admitted)" if let_through else
                     f": no case fails without it: {' '.join(message.split())[:80]}"))


def eval_list(policy, var):
    (prg,) = [p for n, p in policy.variables if n == var]
    return [str(x) for x in prg.evaluate({"object": policy.celpy.json_to_cel({}), "variables": policy.celtypes.MapType({})})]


# --- schemas -----------------------------------------------------------------------------------

CRD_GROUPS = ("monitoring.coreos.com/",)


def validate(kv, node, crd_dir, out, name, docs):
    builtin = [d for d in docs if not d["apiVersion"].startswith(CRD_GROUPS)]
    custom = [d for d in docs if d["apiVersion"].startswith(CRD_GROUPS)]
    f = out / f"{name}.builtin.yaml"
    f.write_text(yaml.safe_dump_all(builtin))
    r = subprocess.run([kv, "--strict", "--quiet", "--kubernetes-version", K8S_VERSION, str(f)],
                       capture_output=True, text=True)
    check(r.returncode == 0, f"{name}: {len(builtin)} objects valid against Kubernetes {K8S_VERSION}"
          + ("" if r.returncode == 0 else "\n" + r.stdout + r.stderr))
    if custom:
        j = out / f"{name}.custom.json"
        j.write_text(json.dumps(custom))
        r = subprocess.run([node, str(ROOT / "scripts" / "validate-crds.mjs"), str(crd_dir), str(j)],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"{name}: {len(custom)} custom resources valid against their CRD schema"
              + ("\n" + r.stdout + r.stderr if r.returncode else ""))
        if r.returncode == 0:
            print("     " + r.stdout.strip().replace("\n", "\n     "))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--kubernetes-validate", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--crd-models", required=True, help="where npm installed the CRD models")
    ap.add_argument("--out", default=str(ROOT / "target" / "deploy-check"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    variants = {"base": []}
    variants.update({c: [c] for c in COMPONENTS})
    variants["all-components"] = COMPONENTS
    base_docs = None
    for name, comps in variants.items():
        _, docs = render(a.kubectl, out, name, comps)
        base_docs = base_docs or docs
        check_variant(name, comps, docs)
        validate(a.kubernetes_validate, a.node, a.crd_models, out, name, docs)

    # The examples and the policy's test objects are requests the API server could receive.
    files = sorted(str(p) for d in ("deploy/examples", "deploy/tests", "examples")
                   for p in (ROOT / d).rglob("*") if p.suffix in (".yaml", ".yml"))
    r = subprocess.run([a.kubernetes_validate, "--strict", "--quiet", "--kubernetes-version", K8S_VERSION, *files],
                       capture_output=True, text=True)
    check(r.returncode == 0, f"examples: {len(files)} files valid" + ("\n" + r.stdout + r.stderr if r.returncode else ""))
    json.loads((DEPLOY / "grafana" / "cuvisor-dashboard.json").read_text())
    check(True, "deploy/grafana/cuvisor-dashboard.json is JSON")

    check_policy(base_docs)
    print(f"deploy: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
