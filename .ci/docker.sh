# Sourced by .ci/run: a real Docker Engine for the tests marked docker_engine.
#
# docker_up installs Debian's docker.io and debootstrap where missing, starts dockerd where no daemon answers (its
# log in $DOCKERD_LOG), says which Engine answers, and builds the images those tests run (docker/images.sh: cached
# by tag, seconds when built before). docker_down stops the dockerd that docker_up started, and nothing else:
# .ci/run calls it on any exit.

sudo_=$([ "$(id -u)" -eq 0 ] || echo sudo)
DOCKERD_LOG=${DOCKERD_LOG:-${TMPDIR:-/tmp}/batchbench-ci-dockerd.log}
dockerd_pid=""

docker_up() {
    local missing=() started=$SECONDS
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        { $sudo_ apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
            || { $sudo_ apt-get update -qq && $sudo_ apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }; } \
            || { echo "ci: cannot install ${missing[*]}"; return 1; }
        echo "ci: installed ${missing[*]} in $((SECONDS - started))s"
    fi
    if ! docker version >/dev/null 2>&1; then
        $sudo_ dockerd >"$DOCKERD_LOG" 2>&1 &
        dockerd_pid=$!
        local waited=0
        until docker version >/dev/null 2>&1; do
            if [ $waited -ge 60 ] || ! kill -0 "$dockerd_pid" 2>/dev/null; then
                echo "ci: dockerd did not start; the end of its log ($DOCKERD_LOG):"
                tail -n 20 "$DOCKERD_LOG"
                return 1
            fi
            sleep 1
            waited=$((waited + 1))
        done
        echo "ci: started dockerd (pid $dockerd_pid) in ${waited}s"
    fi
    echo "ci: Docker Engine $(docker version -f '{{.Server.Version}} (API {{.Server.APIVersion}})'), $(docker info -f \
        'storage {{.Driver}}, cgroup v{{.CgroupVersion}}' 2>/dev/null)"
    docker/images.sh base protocol vllm-cpu ray || return 1
    echo "ci: Docker Engine and images ready in $((SECONDS - started))s"
}

docker_down() {
    [ -n "$dockerd_pid" ] || return 0
    $sudo_ kill -TERM "$dockerd_pid" 2>/dev/null
    local waited=0
    while kill -0 "$dockerd_pid" 2>/dev/null && [ $waited -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
    echo "ci: stopped the dockerd it started"
    dockerd_pid=""
}
