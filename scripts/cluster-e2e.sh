#!/usr/bin/env bash
# End-to-end check of rlfleet on a real Kubernetes cluster (kind by default).
#
#   scripts/cluster-e2e.sh            # creates a kind cluster "rlfleet-e2e", runs the check, deletes it
#   KEEP=1 scripts/cluster-e2e.sh     # keep the cluster afterwards
#   CLUSTER=existing scripts/cluster-e2e.sh   # use the current kubectl context instead of kind
#
# Needs: docker, kind (unless CLUSTER=existing), kubectl, helm, python3 with rlfleet installed.
# It builds the CPU and operator images, installs the chart with its in-chart Redis and a MinIO store, applies
# the arithmetic example as an RLRun (20 steps), scales the InferencePool through the scale
# subresource while it trains, waits for condition Complete, checks the finished run released its
# workloads, deletes the run and checks its children, pools and tiers are gone.
set -euo pipefail
cd "$(dirname "$0")/.."

NS=${NS:-rlfleet-e2e}
CLUSTER=${CLUSTER:-kind}
STEPS=${STEPS:-20}
TIMEOUT=${TIMEOUT:-1800}
VERSION=$(python3 -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
IMAGE=ghcr.io/rlfleet/rlfleet:${VERSION}
OPERATOR_IMAGE=ghcr.io/rlfleet/rlfleet-operator:${VERSION}
WORK=$(mktemp -d)

cleanup() {
  kubectl -n "$NS" get rlfleet,pods -o wide || true
  if [ "$CLUSTER" = kind ] && [ -z "${KEEP:-}" ]; then kind delete cluster --name rlfleet-e2e; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

if [ "$CLUSTER" = kind ]; then
  step "kind cluster"
  kind get clusters | grep -qx rlfleet-e2e || kind create cluster --name rlfleet-e2e --wait 120s
fi

step "images $IMAGE $OPERATOR_IMAGE"
docker build -f docker/Dockerfile.cpu -t "$IMAGE" .
docker build -f docker/Dockerfile.operator -t "$OPERATOR_IMAGE" .
[ "$CLUSTER" = kind ] && kind load docker-image "$IMAGE" "$OPERATOR_IMAGE" --name rlfleet-e2e

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -

step "MinIO as the S3 checkpoint store"
kubectl -n "$NS" apply -f - <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata: {name: minio}
spec:
  selector: {matchLabels: {app: minio}}
  template:
    metadata: {labels: {app: minio}}
    spec:
      containers:
        - name: minio
          image: quay.io/minio/minio:latest
          args: ["server", "/data"]
          env: [{name: MINIO_ROOT_USER, value: rlfleet}, {name: MINIO_ROOT_PASSWORD, value: rlfleet-secret}]
          ports: [{containerPort: 9000}]
---
apiVersion: v1
kind: Service
metadata: {name: minio}
spec: {selector: {app: minio}, ports: [{port: 9000}]}
EOF
kubectl -n "$NS" rollout status deploy/minio --timeout=5m
kubectl -n "$NS" run mkbucket --rm -i --restart=Never --image=quay.io/minio/mc:latest --command -- \
  sh -c 'mc alias set s3 http://minio:9000 rlfleet rlfleet-secret && mc mb --ignore-existing s3/rlfleet'
kubectl -n "$NS" create secret generic s3-creds --dry-run=client -o yaml \
  --from-literal=AWS_ACCESS_KEY_ID=rlfleet --from-literal=AWS_SECRET_ACCESS_KEY=rlfleet-secret | kubectl apply -f -

step "chart (operator, CRDs, in-chart Redis with a generated password, MinIO as the runs' default store)"
helm upgrade --install rlfleet charts/rlfleet -n "$NS" --set fullnameOverride=rlfleet \
  --set redis.enabled=true --set "operator.watchNamespaces={$NS}" \
  --set defaults.store.uri=s3://rlfleet/runs --set "defaults.store.endpointUrl=http://minio.$NS.svc:9000" \
  --set defaults.store.credentialsSecret=s3-creds --wait --timeout 5m

step "RLRun ($STEPS steps)"
python3 - "$STEPS" > "$WORK/rlrun.yaml" <<'EOF'
import sys, yaml
steps = int(sys.argv[1])
docs = [d for d in yaml.safe_load_all(open("examples/arithmetic/rlrun.yaml")) if d]
spec = docs[0]["spec"]
spec["trainer"]["steps"] = steps
# No spec.redis, spec.store or signing key: the operator fills in the chart's (docs/kubernetes.md, One apply).
# Small requests, so the whole run fits one kind node (the defaults ask for about 5 CPUs and 11 GiB).
small = {"requests": {"cpu": "100m", "memory": "512Mi"}}
for section in ("trainer", "verifier"):
    spec[section]["resources"] = small
spec["origin"] = {"resources": small}
for doc in docs[1:]:
    doc["spec"]["resources"] = small
print(yaml.safe_dump_all(docs))
EOF
rlfleet validate "$WORK/rlrun.yaml"
kubectl -n "$NS" apply -f "$WORK/rlrun.yaml"

step "scale subresource (while the run trains)"
for _ in $(seq 60); do kubectl -n "$NS" get deploy/arithmetic-cpu-rollout >/dev/null 2>&1 && break; sleep 2; done
kubectl -n "$NS" scale inferencepool.rlfleet.io/arithmetic-cpu --replicas=3
kubectl -n "$NS" wait --for=jsonpath='{.spec.replicas}'=3 deploy/arithmetic-cpu-rollout --timeout=120s

step "waiting for condition Complete"
kubectl -n "$NS" wait --for=condition=Complete rlrun/arithmetic --timeout="${TIMEOUT}s" || {
  kubectl -n "$NS" describe rlrun arithmetic; exit 1; }
kubectl -n "$NS" get rlrun arithmetic -o wide

step "a finished run releases its workloads"
for workload in statefulset/arithmetic-trainer deploy/arithmetic-verifier deploy/arithmetic-cpu-rollout; do
  kubectl -n "$NS" wait --for=jsonpath='{.spec.replicas}'=0 "$workload" --timeout=120s
done

step "delete and clean up"
kubectl -n "$NS" delete rlrun arithmetic --wait --timeout=5m
for child in statefulset/arithmetic-trainer deploy/arithmetic-verifier deploy/arithmetic-origin \
    inferencepool.rlfleet.io/arithmetic-cpu relaytier.rlfleet.io/arithmetic-tier0; do
  kubectl -n "$NS" wait --for=delete "$child" --timeout=120s
done
echo "cluster end-to-end check passed"
