#!/usr/bin/env bash
# Build the diloco-p2p image with podman and check that it trains and that the dashboard works:
#
#   deploy/smoke.sh              # base image (if missing), wheelhouse, image, then the swarm check
#   deploy/smoke.sh --build-only # base image, wheelhouse and image only
#
# Needs (Debian): podman buildah runc debootstrap prometheus, root, and python3 3.11 with pip on
# the host (the wheels must fit Debian bookworm's python3.11). No image registry is used:
#
# 1. Base: `debootstrap --variant=minbase bookworm` into a temporary folder, imported as
#    $BASE_IMAGE (skipped when podman already has it; ~1 min). Debian's mirror is the only
#    download; the image build installs python3 from it too.
# 2. Wheelhouse: the host's pip puts torch==$TORCH_VERSION (the CPU build on this kind of
#    machine) and every dependency in pyproject.toml into $CACHE/wheels; pip in the build installs
#    from it offline (--no-index). The project itself is installed from the build context.
# 3. Image: `podman build` of deploy/Dockerfile with BASE_IMAGE and the wheelhouse as the build
#    context `wheels`. Cached layers make a rebuild after a code change cost only the last step.
# 4. Swarm: a DHT seed and two nodes as containers (host network, every port on 127.0.0.1, named
#    volumes as in docker-compose.yml: the nodes read the seed's multiaddr from its volume),
#    configs/tiny-cpu.yaml with $INNER_STEPS inner steps a round. Waits until both nodes have
#    committed $ROUNDS rounds, checks both ended rounds 1..$ROUNDS with the same params_sha256
#    (metrics.jsonl in their volumes), then stops them with SIGTERM (a clean exit, code 0).
# 5. Dashboard: a real Prometheus server (deploy/alerts.yml loaded, jobs named as in
#    deploy/prometheus.yml, 1 s scrapes) scrapes the seed and both nodes from their start; every
#    query of grafana/dashboards/diloco.json must return a series with a number (not NaN) through
#    /api/v1/query (deploy/smoke_checks.py). Panels whose numbers only an event makes:
#    - "Peers dropped / state downloads" and "State download bytes": no peer drops out and nobody
#      joins late in this swarm, so they show 0. They still return data, because the node exports
#      every counter and histogram at 0 from its start (diloco_p2p/loop/metrics.py) and increase() of a
#      0 series is 0; a node that resyncs makes them non-zero (tests/integration cover that).
#    - "Loss" (eval loss), "Params agree", "All-reduce time", "Group size": NaN or empty until a
#      node has ended a group round; after $ROUNDS committed rounds they have numbers, so they are
#      checked like every other panel.
#
# Everything started here (containers, volumes, Prometheus, temporary folders) is removed on exit,
# success or not; images stay in podman's store as the cache for the next run. Timings are printed
# as "measured:" lines. Environment: CACHE, BASE_IMAGE, IMAGE, ROUNDS, INNER_STEPS, NICE (niceness
# of the swarm's processes), DEBIAN_MIRROR, TORCH_VERSION, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${CACHE:-/var/tmp/diloco-p2p-deploy}
BASE_IMAGE=${BASE_IMAGE:-localhost/diloco-p2p-base:bookworm}
IMAGE=${IMAGE:-localhost/diloco-p2p:cpu}
ROUNDS=${ROUNDS:-3}
INNER_STEPS=${INNER_STEPS:-10}
NICE=${NICE:-15}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}
# crun refuses this kind of host's hybrid cgroups; runc works. The ulimits: the default rlimits
# podman asks for are above what this host lets a container set.
PODMAN=(podman --runtime runc)
RUN=(--network host --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
NAME=diloco-smoke-$$
BUILD_ONLY=0
[ "${1:-}" = --build-only ] && BUILD_ONLY=1

for tool in podman runc "$PYTHON"; do
    command -v "$tool" >/dev/null || { echo "smoke: $tool is not installed" >&2; exit 2; }
done
[ "$BUILD_ONLY" = 1 ] || command -v prometheus >/dev/null \
    || { echo "smoke: prometheus is not installed (apt-get install prometheus)" >&2; exit 2; }

WORK=$(mktemp -d /var/tmp/diloco-smoke.XXXXXX)
CONTAINERS=()
VOLUMES=()
PROM_PID=
exec 3>&1 4>&2  # the script's own output: a signal can arrive inside a redirected command
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    exec 1>&3 2>&4
    if [ "$rc" != 0 ]; then
        for c in "${CONTAINERS[@]}"; do
            echo "--- last lines of $c" >&2
            # The log file itself: bookworm's podman 4.3 `podman logs` prints nothing for a container
            # that has exited. Its lines are "<time> <stream> <flag> <text>".
            log=$(podman inspect --format '{{.HostConfig.LogConfig.Path}}' "$c" 2>/dev/null) \
                && tail -n 30 "$log" | cut -d' ' -f4- >&2 || true
        done
        [ -f "$WORK/prometheus.log" ] && { echo "--- prometheus" >&2; tail -n 20 "$WORK/prometheus.log" >&2; }
    fi
    for c in "${CONTAINERS[@]}"; do "${PODMAN[@]}" rm -f -v -t 5 "$c" >/dev/null 2>&1 || true; done
    for v in "${VOLUMES[@]}"; do podman volume rm -f "$v" >/dev/null 2>&1 || true; done
    if [ -n "$PROM_PID" ]; then kill "$PROM_PID" 2>/dev/null || true; wait "$PROM_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# wait_for SECONDS WHAT COMMAND...: poll COMMAND every second until it succeeds.
wait_for() {
    local limit=$1 what=$2 start=$SECONDS
    shift 2
    until "$@" >/dev/null 2>&1; do
        if (( SECONDS - start > limit )); then echo "smoke: timed out after ${limit}s waiting for $what" >&2; return 1; fi
        for c in "${CONTAINERS[@]}"; do
            if [ "$("${PODMAN[@]}" inspect --format '{{.State.Running}}' "$c")" != true ]; then
                echo "smoke: container $c exited while waiting for $what" >&2; return 1
            fi
        done
        sleep 1
    done
}

# -- 1. the base image ---------------------------------------------------------------------------
if ! podman image exists "$BASE_IMAGE"; then
    command -v debootstrap >/dev/null || { echo "smoke: debootstrap is not installed" >&2; exit 2; }
    echo "+ debootstrap --variant=minbase bookworm ($DEBIAN_MIRROR) -> $BASE_IMAGE"
    t=$(now)
    nice -n "$NICE" debootstrap --variant=minbase bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }
    tar -C "$WORK/rootfs" -c . | podman import -q - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
    echo "measured: base image in $(since "$t") s"
fi

# -- 2. the wheelhouse ---------------------------------------------------------------------------
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { echo "smoke: $PYTHON is not Python 3.11, whose wheels Debian bookworm's python3 needs" >&2; exit 2; }
# The dependencies and the build backend (pip builds the project inside the image, offline).
mapfile -t DEPS < <("$PYTHON" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))
print(*p["project"]["dependencies"], *p["build-system"]["requires"], sep="\n")')
# The requirements it was made for are kept next to it: the same ones reuse it without asking pip.
REQUIREMENTS="torch==$TORCH_VERSION ${DEPS[*]}"
if [ "$(cat "$CACHE/wheels/.requirements" 2>/dev/null)" != "$REQUIREMENTS" ]; then
    echo "+ pip wheel torch==$TORCH_VERSION + ${#DEPS[@]} dependencies -> $CACHE/wheels"
    t=$(now)
    mkdir -p "$CACHE/wheels"
    rm -f "$CACHE/wheels/.requirements"
    nice -n "$NICE" "$PYTHON" -m pip wheel --wheel-dir "$CACHE/wheels" "torch==$TORCH_VERSION" "${DEPS[@]}" \
        >"$WORK/pip.log" 2>&1 || { tail -n 20 "$WORK/pip.log" >&2; exit 1; }
    echo "$REQUIREMENTS" >"$CACHE/wheels/.requirements"
    echo "measured: wheelhouse in $(since "$t") s ($(du -sh "$CACHE/wheels" | cut -f1))"
fi

# -- 3. the image ----------------------------------------------------------------------------------
# --skip-unused-stages=false: buildah 1.28 (bookworm's podman) does not see that `FROM
# torch-${VARIANT}` uses a stage and would look for an image of that name.
echo "+ podman build -> $IMAGE"
t=$(now)
nice -n "$NICE" "${PODMAN[@]}" build -q --network host --skip-unused-stages=false \
    -f deploy/Dockerfile --ignorefile deploy/Dockerfile.dockerignore \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-context wheels="$CACHE/wheels" -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; exit 1; }
echo "measured: image build in $(since "$t") s; $IMAGE is $(podman image inspect --format '{{.Size}}' "$IMAGE" \
    | awk '{ printf "%.2f GB", $1 / 1e9 }')"
[ "$BUILD_ONLY" = 1 ] && exit 0

# -- 4. the swarm ----------------------------------------------------------------------------------
DHT_PORT=$(free_port); SEED_METRICS=$(free_port); PROM_PORT=$(free_port)
NODE_METRICS=("$(free_port)" "$(free_port)")
for v in seed node1 node2; do
    podman volume create "$NAME-$v" >/dev/null
    VOLUMES+=("$NAME-$v")
done
mountpoint() { podman volume inspect --format '{{.Mountpoint}}' "$NAME-$1"; }
# `nice` as the entrypoint keeps the swarm from starving other work on a small machine.
run() { local name=$1; shift; CONTAINERS+=("$NAME-$name"); "${PODMAN[@]}" run -d --name "$NAME-$name" "${RUN[@]}" "$@" >/dev/null; }

t_seed=$(now)
run seed -v "$NAME-seed:/data" --entrypoint nice "$IMAGE" -n "$NICE" diloco-p2p seed \
    --identity /data/seed.key --host-maddrs "/ip4/127.0.0.1/tcp/$DHT_PORT" --maddrs-file /data/maddrs.txt \
    --metrics-port "$SEED_METRICS" --metrics-host 127.0.0.1
wait_for 60 "the seed's multiaddr" test -s "$(mountpoint seed)/maddrs.txt"
echo "seed: $(cat "$(mountpoint seed)/maddrs.txt") after $(since "$t_seed") s"

# Prometheus from the start, so that rate() and increase() have samples from round 0 on.
cat >"$WORK/prometheus.yml" <<EOF
global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}
rule_files: [alerts.yml]
scrape_configs:
  - job_name: diloco-seed
    static_configs: [{targets: ["127.0.0.1:$SEED_METRICS"], labels: {role: seed}}]
  - job_name: diloco-node
    static_configs: [{targets: ["127.0.0.1:${NODE_METRICS[0]}", "127.0.0.1:${NODE_METRICS[1]}"], labels: {role: node}}]
EOF
cp deploy/alerts.yml "$WORK/alerts.yml"
promtool check config "$WORK/prometheus.yml" >/dev/null
nice -n "$NICE" prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
PROM=http://127.0.0.1:$PROM_PORT
wait_for 60 "Prometheus" "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$PROM/-/ready', timeout=2)"

t_nodes=$(now)
for i in 1 2; do
    run "node$i" -v "$NAME-seed:/seed:ro" -v "$NAME-node$i:/data" --entrypoint nice "$IMAGE" -n "$NICE" \
        diloco-p2p train --config /app/configs/tiny-cpu.yaml --initial-peers-file /seed/maddrs.txt --run-dir /data \
        --metrics-port "${NODE_METRICS[$((i - 1))]}" --metrics-host 127.0.0.1 \
        --set 'p2p.host_maddrs=[/ip4/127.0.0.1/tcp/0]' --set train.max_rounds=1000 \
        --set outer.inner_steps="$INNER_STEPS" --set train.num_threads=1
done
# max_rounds is large so that the nodes keep serving metrics while Prometheus is read; they are
# stopped below, after round $ROUNDS.
runs=("$(mountpoint node1)" "$(mountpoint node2)")
committed() { [ "$("$PYTHON" deploy/smoke_checks.py committed "${runs[@]}")" -ge "$1" ]; }
wait_for 300 "a committed round on both nodes" committed 1
echo "measured: first committed round on both nodes $(since "$t_nodes") s after the nodes' start"
wait_for 300 "$ROUNDS committed rounds on both nodes" committed "$ROUNDS"
echo "measured: $ROUNDS committed rounds on both nodes $(since "$t_nodes") s after the nodes' start"

# Prometheus has scraped the last round when its diloco_round says so for both nodes.
scraped() {
    "$PYTHON" - "$PROM" "$ROUNDS" <<'EOF'
import json, sys, urllib.parse, urllib.request
url = f"{sys.argv[1]}/api/v1/query?" + urllib.parse.urlencode({"query": 'min(diloco_round{job="diloco-node"}) >= ' + sys.argv[2]})
with urllib.request.urlopen(url, timeout=5) as r:
    sys.exit(0 if json.loads(r.read())["data"]["result"] else 1)
EOF
}
wait_for 30 "Prometheus to scrape round $ROUNDS" scraped
"$PYTHON" deploy/smoke_checks.py dashboard "$PROM"

"${PODMAN[@]}" stop -t 30 "$NAME-node1" "$NAME-node2" >/dev/null
for i in 1 2; do
    code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$NAME-node$i")
    [ "$code" = 0 ] || { echo "smoke: node$i exited with $code after SIGTERM" >&2; exit 1; }
done
"$PYTHON" deploy/smoke_checks.py theta "$ROUNDS" "${runs[@]}"
echo "smoke: OK: image $IMAGE, seed + 2 nodes, $ROUNDS rounds with identical θ, every dashboard query has data"
