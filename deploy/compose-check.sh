#!/usr/bin/env bash
# Checks `docker compose up` for real, from a fresh clone, on a Debian machine (root): the
# project's image from its own Dockerfile, the stack from its own compose.yaml, and what the
# stack promises: requests through the gateway, one trace across the roles, every replica in
# Prometheus, a decode worker killed mid-stream (migration), a stop mid-stream (drain), prompt
# stops when idle, decode scaling, and a `down` that leaves nothing behind.
#
#   deploy/compose-check.sh [--quick] [--reuse-image] [--keep-images] [--keep-engine] [--purge]
#
#   --quick        scaling: one run of each setting instead of the median of three
#   --reuse-image  use the nori:latest there (from a --keep-images run), not a new build
#   --keep-images  keep the images it built and Docker's data for a faster rerun
#   --keep-engine  leave the Docker engine it started running (implies --keep-images); a rerun
#                  adopts it, and stops it unless given --keep-engine again
#   --purge        also remove the packages it installed and its cache (the Debian root
#                  filesystem, the torch index, the client venv) under $NORI_CHECK_CACHE
#
# Where no Docker engine runs it installs and starts Debian's, and undoes that at the end
# (deploy/compose-check-engine.sh). Where Docker Hub cannot be reached it builds stand-ins for the
# public images (deploy/standins/build.sh) and says so; where the torch index cannot be reached it
# serves the wheel pip finds here from a loopback index. Compose v2 where it exists, else 1.29+.
#
# Every step prints PASS or FAIL with its time; the first FAIL stops the check (the cleanup runs
# all the same) and the script exits 1. Environment: NORI_CHECK_CACHE (default
# /var/cache/nori-compose-check), NORI_CHECK_TIMEOUT_S (health wait, default 600),
# NORI_DECODE_CPUS / NORI_PREFILL_CPUS (passed to compose.yaml), NORI_SCALED_DECODE_CPUS (each
# replica's CPUs in the scaled run of the scaling step, default 1), NORI_MODEL.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
here="$repo/deploy"
cache="${NORI_CHECK_CACHE:-/var/cache/nori-compose-check}"
state="$cache/state"
project=nori-check
health_timeout="${NORI_CHECK_TIMEOUT_S:-600}"
scaling_runs=3 keep_images=0 keep_engine=0 purge=0 reuse_image=0

for arg in "$@"; do
  case "$arg" in
    --quick) scaling_runs=1 ;;
    --reuse-image) reuse_image=1 ;;
    --keep-images) keep_images=1 ;;
    --keep-engine) keep_engine=1 keep_images=1 ;;
    --purge) purge=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option: $arg (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "run it as root (it installs and starts a Docker engine)" >&2; exit 2; }

mkdir -p "$cache" "$state"
run="$(mktemp -d /tmp/nori-compose-check.XXXXXX)"
chmod 700 "$run"
bg_pids=()          # helpers it started: the torch index server, docker events
stack_up=0          # a stack of project $project may exist
engine_ours=""      # "pid N" or "systemd" where it started (or adopted) the engine
images_built=()     # images it built or tagged
summary=()
t_start=$EPOCHREALTIME

log() { echo "    $*"; }
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# step NUMBER TITLE FUNCTION [ARGS...]: runs it, prints PASS/FAIL and its time; stops at a FAIL.
step() {
  local n="$1" title="$2"; shift 2
  echo
  echo "=== [$n] $title"
  local t0=$EPOCHREALTIME result=PASS
  "$@" || result=FAIL
  local dt; dt="$(elapsed "$t0")"
  echo "$result [$n] $title ($dt s)"
  summary+=("$(printf '%-4s [%2s] %-58s %8s s' "$result" "$n" "$title" "$dt")")
  if [ "$result" = FAIL ]; then exit 1; fi
}

compose() { "${COMPOSE[@]}" -p "$project" -f "$repo/compose.yaml" --project-directory "$repo" "$@"; }
containers() { docker ps -a -q --filter "label=com.docker.compose.project=$project"; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The engine (packages, dockerd, network restore) and the cleanup.
# shellcheck source=deploy/compose-check-engine.sh
source "$here/compose-check-engine.sh"

# ------------------------------------------------------------------------ public images

public_images=(python:3.11-slim redis:7-alpine prom/prometheus:v2.55.1 jaegertracing/all-in-one:1.62.0)

step_images() {
  local image
  # The names the stand-ins take must be those the project uses.
  for image in "${public_images[@]}"; do
    grep -qF "$image" "$repo/compose.yaml" "$repo/Dockerfile" ||
      { log "$image is no longer in compose.yaml or the Dockerfile: update deploy/standins"; return 1; }
  done
  if timeout 30 docker pull -q "${public_images[0]}" >"$run/pull.log" 2>&1; then
    for image in "${public_images[@]:1}"; do
      timeout 300 docker pull -q "$image" >>"$run/pull.log" 2>&1 || { tail -3 "$run/pull.log"; return 1; }
    done
    log "pulled the public images from their registry"
    return 0
  fi
  log "cannot pull ${public_images[0]}: $(tail -1 "$run/pull.log")"
  log "Docker Hub is unreachable: building STAND-INS from Debian packages under the same names"
  log "(deploy/standins: what compose.yaml relies on, not the real images)"
  command -v debootstrap >/dev/null || ensure_packages debootstrap || return 1
  NORI_CHECK_CACHE="$cache" "$here/standins/build.sh" "${public_images[@]}" 2>&1 | sed 's/^/    /'
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  for image in "${public_images[@]}"; do
    log "$(printf '%-34s %s' "$image" "$(docker image inspect -f \
      '{{with index .Config.Labels "org.nori.compose-check.standin"}}stand-in ({{.}}){{else}}real image{{end}}, {{.Size}} bytes' "$image")")"
  done
  images_built+=("${public_images[@]}" nori-check/debian:bookworm-minbase)
}

# ------------------------------------------------------------------------ the project's image

# A PEP 503 index on loopback with the torch wheel pip finds on this machine.
serve_torch_index() {
  local spec="$1" index="$cache/torch-index"
  if ! ls "$index"/simple/torch/*.whl >/dev/null 2>&1; then
    mkdir -p "$index/simple/torch"
    log "fetching $spec with pip download (this machine's wheels first)"
    python3 -m pip download -q "$spec" --no-deps --only-binary :all: --python-version 3.11 \
      --implementation cp --platform manylinux_2_28_x86_64 -d "$index/simple/torch" >"$run/pip-download.log" 2>&1 ||
      { tail -5 "$run/pip-download.log"; return 1; }
  fi
  local wheel sha
  wheel="$(basename "$(ls "$index"/simple/torch/*.whl | head -1)")"
  sha="$(sha256sum "$index/simple/torch/$wheel" | cut -d' ' -f1)"
  printf '<!DOCTYPE html>\n<html><body><a href="torch/">torch</a></body></html>\n' >"$index/simple/index.html"
  printf '<!DOCTYPE html>\n<html><body><a href="%s#sha256=%s">%s</a></body></html>\n' \
    "${wheel//+/%2B}" "$sha" "$wheel" >"$index/simple/torch/index.html"
  torch_port="$(free_port)"
  python3 -m http.server "$torch_port" --bind 127.0.0.1 --directory "$index" >"$run/torch-index.log" 2>&1 &
  bg_pids+=($!)
  local i
  for i in $(seq 20); do curl -sf -o /dev/null "http://127.0.0.1:$torch_port/simple/torch/" && break; sleep 0.5; done
  log "serving $wheel at http://127.0.0.1:$torch_port/simple"
}

step_build() {
  local spec index args=() size
  if [ "$reuse_image" = 1 ] && size="$(docker image inspect -f '{{.Size}}' nori:latest 2>/dev/null)"; then
    log "--reuse-image: nori:latest as it is, built $(docker image inspect -f '{{.Created}}' nori:latest), not rebuilt"
    log "image size $size bytes ($(numfmt --to=iec "$size"))"
    build_summary="reused (not built), nori:latest $(numfmt --to=iec "$size") ($size bytes)"
    images_built+=(nori:latest)
    return 0
  fi
  spec="$(sed -n 's/^ARG TORCH_SPEC="\(.*\)"/\1/p' "$repo/Dockerfile")"
  index="$(sed -n 's/^ARG TORCH_INDEX_URL="\(.*\)"/\1/p' "$repo/Dockerfile")"
  if [ -n "$index" ] && ! curl -sf -m 10 -o /dev/null "$index/torch/"; then
    log "the Dockerfile's torch index ($index) is unreachable: a local index instead"
    serve_torch_index "${spec:-torch}" || return 1
    args+=(--build-arg "TORCH_INDEX_URL=http://127.0.0.1:$torch_port/simple")
  fi
  log "docker build --network host ${args[*]} -t nori:latest $repo"
  local t0=$EPOCHREALTIME
  docker build --network host "${args[@]}" -t nori:latest "$repo" >"$run/build.log" 2>&1 ||
    { tail -30 "$run/build.log" | sed 's/^/    | /'; return 1; }
  images_built+=(nori:latest)
  size="$(docker image inspect -f '{{.Size}}' nori:latest)"
  log "built nori:latest in $(elapsed "$t0") s; image size $size bytes ($(numfmt --to=iec "$size"))"
  build_summary="build $(elapsed "$t0") s, nori:latest $(numfmt --to=iec "$size") ($size bytes)"
}

# ------------------------------------------------------------------------ the stack

# The client side runs from a venv of its own (openai, httpx), not the project's: what it
# checks then does not depend on the state of a development environment.
setup_client() {
  local venv="$cache/client-venv"
  if ! "$venv/bin/python" -c 'import openai, httpx' 2>/dev/null; then
    log "a venv for the client: $venv (openai, httpx)"
    rm -rf "$venv"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q openai httpx >"$run/pip.log" 2>&1 ||
      { tail -5 "$run/pip.log"; return 1; }
  fi
  PY="$venv/bin/python"
  log "client: $("$PY" -c 'import openai, httpx; print(f"openai {openai.__version__}, httpx {httpx.__version__}")')"
}
check() { "$PY" "$here/compose_check.py" "$@" 2>&1 | sed 's/^/    /'; return "${PIPESTATUS[0]}"; }

# Waits until every container of the project runs and is healthy (or has no health check);
# prints each one's state and how long it took. A container that exits or restarts while it
# waits fails at once (restarts before it began, e.g. after a `docker kill`, do not count).
wait_healthy() {
  local t0=$EPOCHREALTIME deadline=$((SECONDS + health_timeout)) all c line name status health restarts
  declare -A ready=() base=()
  for c in $(containers); do base[$c]="$(docker inspect -f '{{.RestartCount}}' "$c" 2>/dev/null)"; done
  while :; do
    all=1
    for c in $(containers); do
      line="$(docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} {{.RestartCount}}' "$c" 2>/dev/null)" || continue
      read -r name status health restarts <<<"$line"
      name="${name#/}"
      if [ "$status" = exited ] || [ "$status" = dead ] || [ "$status" = restarting ] ||
        [ "$restarts" -gt "${base[$c]:-0}" ]; then
        log "$name: $status (restarts: $restarts); its last log lines:"
        docker logs --tail 25 "$c" 2>&1 | sed 's/^/    | /'
        return 1
      fi
      if [ "$status" = running ] && { [ "$health" = healthy ] || [ "$health" = - ]; }; then
        [ -n "${ready[$name]:-}" ] || ready[$name]="$(elapsed "$t0")"
      else
        all=0
      fi
    done
    [ "$all" = 1 ] && [ -n "$(containers)" ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "not healthy after $health_timeout s:"
      docker ps -a --filter "label=com.docker.compose.project=$project" --format '{{.Names}}\t{{.Status}}' | sed 's/^/    /'
      return 1
    fi
    sleep 2
  done
  for c in $(containers); do
    line="$(docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}(no health check){{end}}' "$c")"
    read -r name status health <<<"$line"
    name="${name#/}"
    log "$(printf '%-28s %-8s %-18s ready after %6s s' "$name" "$status" "$health" "${ready[$name]}")"
  done | sort
}

step_up() {
  setup_client || return 1
  export NORI_SECRETS_DIR="$run/secrets" NORI_MODELS_DIR="$run/models" NORI_BIND_ADDRESS=127.0.0.1
  export NORI_PORT="${NORI_PORT:-$(free_port)}" NORI_JAEGER_PORT="${NORI_JAEGER_PORT:-$(free_port)}"
  export NORI_PROMETHEUS_PORT="${NORI_PROMETHEUS_PORT:-$(free_port)}"
  mkdir -p "$NORI_MODELS_DIR"
  "$repo/deploy/make-secrets.sh" "$NORI_SECRETS_DIR" | sed 's/^/    /' || return 1
  export NORI_CHECK_BASE_URL="http://127.0.0.1:$NORI_PORT"
  NORI_CHECK_API_KEY="$(cat "$NORI_SECRETS_DIR/api_key" 2>/dev/null || echo none)"
  export NORI_CHECK_API_KEY
  [ -s "$NORI_SECRETS_DIR/api_key" ] || log "no api_key secret: the gateway's API is open"
  log "project $project: gateway 127.0.0.1:$NORI_PORT, Jaeger 127.0.0.1:$NORI_JAEGER_PORT," \
    "Prometheus 127.0.0.1:$NORI_PROMETHEUS_PORT, secrets $NORI_SECRETS_DIR"
  docker volume ls -q | sort >"$run/volumes-before"
  docker network ls -q | sort >"$run/networks-before"
  stack_up=1
  compose up -d --no-build >"$run/up.log" 2>&1 || { tail -20 "$run/up.log" | sed 's/^/    | /'; return 1; }
  compose up -d --no-build --scale decode=2 >>"$run/up.log" 2>&1 || { tail -20 "$run/up.log" | sed 's/^/    | /'; return 1; }
  log "up -d, then up -d --scale decode=2: waiting for every health check"
  wait_healthy || return 1
  check wait-gateway --decode 2 --timeout 120
}

step_requests() { check requests --concurrent 20; }

step_trace() {
  check trace --jaeger "http://127.0.0.1:$NORI_JAEGER_PORT" --services nori-gateway nori-prefill nori-decode
}

step_targets() {
  log "Prometheus' scrape targets (http://127.0.0.1:$NORI_PROMETHEUS_PORT/api/v1/targets):"
  check targets --prometheus "http://127.0.0.1:$NORI_PROMETHEUS_PORT" \
    --expect nori-gateway=1 nori-prefill=1 nori-decode=2 nori-batch=1
}

step_migration() {
  local decoders gateway
  decoders="$(docker ps -q --filter "label=com.docker.compose.project=$project" \
    --filter label=com.docker.compose.service=decode | tr '\n' ' ')"
  gateway="$(docker ps -q --filter "label=com.docker.compose.project=$project" \
    --filter label=com.docker.compose.service=gateway | head -1)"
  [ -n "$decoders" ] || { log "no decode container"; return 1; }
  log "8 streams of 1000 tokens; docker kill of the busiest decode replica once they all stream"
  # shellcheck disable=SC2086 # the container ids
  check migration --streams 8 --max-tokens 1000 --kill $decoders --gateway "$gateway" || return 1
  local victim; victim="$(docker ps -a -q --filter "label=com.docker.compose.project=$project" \
    --filter label=com.docker.compose.service=decode --filter status=exited | head -1)"
  [ -z "$victim" ] || log "killed: $(docker inspect -f '{{.Name}} {{.State.Status}}, restarts {{.RestartCount}}' "$victim")"
  log "back to two decode replicas (up -d --scale decode=2)"
  sleep 3
  compose up -d --no-build --scale decode=2 >>"$run/up.log" 2>&1 || { tail -20 "$run/up.log"; return 1; }
  wait_healthy || return 1
  check wait-gateway --decode 2 --timeout 180
}

# Per container: from the SIGTERM (docker's kill event, signal 15) to its exit (die), and
# whether it needed a SIGKILL.
stop_times() {
  local events="$1" limit="${2:-}"
  awk -v limit="$limit" '
    $2 == "kill" && $4 == 15 && !($3 in term) { term[$3] = $1 }
    $2 == "kill" && $4 == 9 { killed[$3] = 1 }
    $2 == "die" && !($3 in died) { died[$3] = $1 }
    END {
      bad = 0
      for (c in term) {
        if (!(c in died)) { printf "    %-28s SIGTERM, never exited\n", c; bad = 1; continue }
        s = (died[c] - term[c]) / 1e9
        printf "    %-28s exited %6.2f s after SIGTERM%s\n", c, s, (c in killed) ? " (SIGKILL needed)" : ""
        if (limit != "" && s > limit) bad = 1
        if (c in killed) bad = 1
      }
      exit bad
    }' "$events" | sort
  return "${PIPESTATUS[0]}"
}
watch_events() {
  docker events --since "$(date +%s)" --filter "label=com.docker.compose.project=$project" \
    --filter type=container --format '{{.TimeNano}} {{.Action}} {{.Actor.Attributes.name}} {{.Actor.Attributes.signal}}' >"$1" &
  events_pid=$!
  bg_pids+=("$events_pid")
  sleep 1
}

step_drain() {
  local events="$run/events-drain" rc=0
  watch_events "$events"
  log "8 streams of 1000 tokens; '${COMPOSE[*]} stop' once they all stream; a request while the gateway drains"
  local since; since="$(date +%s)"
  check drain --streams 8 --max-tokens 1000 --stop "$(printf '%q ' "${COMPOSE[@]}" -p "$project" -f "$repo/compose.yaml" --project-directory "$repo" stop)" || rc=1
  sleep 1; kill "$events_pid" 2>/dev/null
  log "how long each container took to stop:"
  stop_times "$events" || true
  if [ "$rc" != 0 ]; then
    local c
    for c in $(docker ps -a --filter "label=com.docker.compose.project=$project" --format '{{.Names}}' | grep -E 'gateway|decode|prefill' | sort); do
      log "$c, its log since the streams began:"
      docker logs --timestamps --since "$since" "$c" 2>&1 | grep -v ' GET /health\| GET /metrics' | tail -12 | cut -c1-240 | sed 's/^/    | /'
    done
  fi
  return "$rc"
}

step_idle_stop() {
  compose up -d --no-build --scale decode=2 >>"$run/up.log" 2>&1 || { tail -20 "$run/up.log"; return 1; }
  log "up -d again: waiting for every health check"
  wait_healthy || return 1
  check wait-gateway --decode 2 --timeout 120 || return 1
  local events="$run/events-idle"
  watch_events "$events"
  log "${COMPOSE[*]} stop -t 30 while idle: each container must exit within 5 s of SIGTERM"
  local t0=$EPOCHREALTIME
  compose stop -t 30 >>"$run/up.log" 2>&1 || return 1
  log "stop took $(elapsed "$t0") s in all"
  sleep 1; kill "$events_pid" 2>/dev/null
  stop_times "$events" 5 | tee "$run/idle-stop" && return 0
  # The slow ones: their last log lines, with times.
  local name
  for name in $(awk '$3 > 5 {print $1}' "$run/idle-stop"); do
    log "$name, its last log lines:"
    docker logs --timestamps --tail 8 "$name" 2>&1 | cut -c1-220 | sed 's/^/    | /'
  done
  return 1
}

# One decode replica as the file runs it, against two, each given its share of the host's CPUs
# (NORI_DECODE_CPUS, default 1 here), as docs/operations.md says to scale on one host: two must
# serve 8 streams of 1,000 tokens no slower (10% for noise).
step_scaling() {
  local one two n cpus
  for n in 1 2; do
    cpus="${NORI_DECODE_CPUS:-0}"
    [ "$n" = 1 ] || cpus="${NORI_SCALED_DECODE_CPUS:-1}"
    NORI_DECODE_CPUS="$cpus" compose up -d --no-build --scale decode=$n >>"$run/up.log" 2>&1 || { tail -20 "$run/up.log"; return 1; }
    wait_healthy >"$run/health-$n" || { cat "$run/health-$n"; return 1; }
    check wait-gateway --decode $n --timeout 180 || return 1
    log "decode=$n (NORI_DECODE_CPUS=$cpus): 8 streams of 1000 tokens, $scaling_runs run(s)"
    check streams --streams 8 --max-tokens 1000 --runs "$scaling_runs" --out "$run/scaling-$n" || return 1
  done
  one="$(cat "$run/scaling-1")" two="$(cat "$run/scaling-2")"
  scaling_summary="8 streams x 1000 tokens, $( [ "$scaling_runs" = 1 ] && echo "1 run each" || echo "median of $scaling_runs"): decode=1 $one s, decode=2 (NORI_DECODE_CPUS=${NORI_SCALED_DECODE_CPUS:-1}) $two s (speed-up x$(awk -v a="$one" -v b="$two" 'BEGIN { printf "%.2f", a / b }'))"
  log "$scaling_summary"
  awk -v a="$one" -v b="$two" 'BEGIN { exit !(b <= 1.1 * a) }' || { log "two replicas were slower than one"; return 1; }
}

step_down() {
  compose down -v --remove-orphans >>"$run/up.log" 2>&1 || { tail -20 "$run/up.log"; return 1; }
  stack_up=0
  local left=0 c n v
  c="$(containers)"; [ -z "$c" ] || { log "containers left: $c"; left=1; }
  n="$(docker network ls -q --filter "label=com.docker.compose.project=$project")"
  n+="$(docker network ls -q | sort | comm -13 "$run/networks-before" -)"
  [ -z "$n" ] || { log "networks left: $n"; left=1; }
  v="$(docker volume ls -q | sort | comm -13 "$run/volumes-before" -)"
  [ -z "$v" ] || { log "volumes left: $v"; left=1; }
  [ "$left" = 0 ] && log "no container, network or volume of project $project is left"
  return "$left"
}

trap cleanup EXIT
trap 'exit 130' INT TERM

echo "nori compose check: $repo, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), project $project"
step 1 "Docker engine and Compose" step_engine
step 2 "public images (pulled, or stand-ins built)" step_images
step 3 "build nori:latest with the project's Dockerfile" step_build
step 4 "up -d, up -d --scale decode=2, every health check healthy" step_up
step 5 "completion, streamed chat completion, 20 concurrent" step_requests
step 6 "one request's spans from gateway, prefill, decode" step_trace
step 7 "every replica a Prometheus target, all up" step_targets
step 8 "kill a decode replica during 8 streams (migration)" step_migration
step 9 "stop during 8 streams: drain, 503 + Retry-After" step_drain
step 10 "up again; every container stops within 5 s idle" step_idle_stop
step 11 "scaling: decode=1 vs decode=2, 8 streams" step_scaling
step 12 "down -v --remove-orphans leaves nothing" step_down
