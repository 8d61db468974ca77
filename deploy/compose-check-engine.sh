# The Docker engine side of deploy/compose-check.sh, sourced by it: installing Debian's
# packages where missing, starting dockerd (or adopting one an earlier run started), and the
# cleanup that stops what it started and restores the host's network (iptables rules, chains
# and policies, ip_forward, bridges) to what it was before dockerd first ran.
# It uses the check's variables: run, state, cache, engine_ours, keep_images, keep_engine,
# purge, images_built, stack_up, bg_pids, summary, COMPOSE.
# shellcheck shell=bash

# ------------------------------------------------------------------------ packages

# Installs the Debian packages that are missing; records what it installed (for --purge).
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  log "installing ${missing[*]} (apt-get)"
  dpkg-query -W -f='${Package}\n' | sort >"$run/dpkg-before"
  apt-get update -qq >"$run/apt.log" 2>&1 || { tail -5 "$run/apt.log"; return 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >>"$run/apt.log" 2>&1 || { tail -15 "$run/apt.log"; return 1; }
  dpkg-query -W -f='${Package}\n' | sort | comm -13 "$run/dpkg-before" - >>"$state/installed-packages"
  sort -u -o "$state/installed-packages" "$state/installed-packages"
}

# ------------------------------------------------------------------------ the engine

docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

# What dockerd changes on the host, saved before it first starts: iptables (v4 and v6, filter
# and nat), ip_forward, the network links. restore_network puts back exactly that.
save_network() {
  local v t
  for v in 4 6; do
    for t in filter nat; do
      "$(ipt "$v")" -t "$t" -S >"$state/ipt$v-$t" 2>/dev/null || : >"$state/ipt$v-$t"
    done
  done
  cat /proc/sys/net/ipv4/ip_forward >"$state/ip_forward"
  ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' >"$state/links"
}
ipt() { if [ "$1" = 6 ]; then echo ip6tables; else echo iptables; fi; }

restore_network() {
  [ -f "$state/links" ] || return 0
  local v t cmd line chain before after
  for v in 4 6; do
    cmd="$(ipt "$v")"
    command -v "$cmd" >/dev/null || continue
    for t in filter nat; do
      before="$state/ipt$v-$t"
      after="$("$cmd" -t "$t" -S 2>/dev/null)" || continue
      # Rules it added (deleted), then chains it added (flushed, then deleted), then policies.
      comm -13 <(grep '^-A' "$before" | sort) <(grep '^-A' <<<"$after" | sort) |
        while read -r line; do xargs "$cmd" -t "$t" <<<"-D ${line#-A }" 2>/dev/null; done
      local chains; chains="$(comm -13 <(grep '^-N' "$before" | sort) <(grep '^-N' <<<"$after" | sort) | awk '{print $2}')"
      for chain in $chains; do "$cmd" -t "$t" -F "$chain" 2>/dev/null; done
      for chain in $chains; do "$cmd" -t "$t" -X "$chain" 2>/dev/null; done
      grep '^-P' "$before" | while read -r line; do xargs "$cmd" -t "$t" <<<"$line" 2>/dev/null; done
    done
  done
  echo "$(cat "$state/ip_forward")" >/proc/sys/net/ipv4/ip_forward
  local link
  for link in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^(docker0|br-[0-9a-f]+|veth)'); do
    grep -qx "$link" "$state/links" || ip link delete "$link" 2>/dev/null
  done
  rm -f "$state"/ipt* "$state/ip_forward" "$state/links"
  log "network restored: iptables rules and chains dockerd added removed, policies," \
    "ip_forward=$(cat /proc/sys/net/ipv4/ip_forward), bridges removed"
}

engine_pid() { [ -s "$state/engine" ] && sed -n 's/^pid //p' "$state/engine"; }

step_engine() {
  if [ -s "$state/engine" ]; then
    local pid; pid="$(engine_pid)"
    if grep -qx systemd "$state/engine" || { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }; then
      engine_ours="$(cat "$state/engine")"
      log "adopting the Docker engine an earlier check run started ($engine_ours); stopped at the end"
    else
      log "an earlier check run's dockerd is gone: undoing its network changes first"
      restore_network
      rm -f "$state/engine"
    fi
  fi
  if [ -z "$engine_ours" ] && docker_ok; then
    log "a Docker engine runs already: used as it is, and left running"
  elif [ -z "$engine_ours" ]; then
    [ -e /var/lib/docker ] || [ -e "$state/docker-data-ours" ] || touch "$state/docker-data-ours"
    if ! command -v dockerd >/dev/null; then
      ensure_packages docker.io docker-compose || return 1
    fi
    save_network
    if [ -d /run/systemd/system ]; then
      systemctl start docker || return 1
      echo systemd >"$state/engine"
    else
      # No systemd: dockerd in the background (it starts its own containerd), its log to a file.
      setsid dockerd >"$cache/dockerd.log" 2>&1 </dev/null &
      echo "pid $!" >"$state/engine"
    fi
    engine_ours="$(cat "$state/engine")"
    local i
    for i in $(seq 60); do docker_ok && break; sleep 1; done
    docker_ok || { tail -20 "$cache/dockerd.log" 2>/dev/null; return 1; }
    log "started dockerd ($engine_ours, log: $cache/dockerd.log)"
  fi
  if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
  else
    command -v docker-compose >/dev/null || ensure_packages docker-compose || return 1
    COMPOSE=(docker-compose)
  fi
  log "engine: Docker $(docker version -f '{{.Server.Version}}' 2>/dev/null)," \
    "client $(docker version -f '{{.Client.Version}}' 2>/dev/null)"
  log "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || "${COMPOSE[@]}" version | head -1))"
  docker image ls -q --no-trunc | sort -u >"$run/images-before"
}


# ------------------------------------------------------------------------ cleanup

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  echo
  echo "=== cleanup"
  local p
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null; done
  if [ "$stack_up" = 1 ] && docker_ok; then
    log "${COMPOSE[*]} -p $project down -v --remove-orphans"
    compose down -v --remove-orphans >>"$run/up.log" 2>&1 || log "down failed: see above"
  fi
  local left=()
  if docker_ok; then
    if [ "$keep_images" = 1 ]; then
      [ "${#images_built[@]}" -eq 0 ] || left+=("images (--keep-images): ${images_built[*]}")
    elif [ -n "$engine_ours" ] && [ "$keep_engine" = 0 ] && [ -e "$state/docker-data-ours" ]; then
      log "the images it built go with Docker's data, removed below"
    elif [ "${#images_built[@]}" -gt 0 ]; then
      local newest_first=() i
      for (( i = ${#images_built[@]} - 1; i >= 0; i-- )); do newest_first+=("${images_built[$i]}"); done
      log "removing the images it built: ${newest_first[*]}"
      docker rmi "${newest_first[@]}" >/dev/null 2>&1
      # The build stage and the layers that only those images used.
      [ -z "$engine_ours" ] || docker image prune -f >/dev/null 2>&1
    fi
  fi
  if [ -n "$engine_ours" ] && [ "$keep_engine" = 1 ]; then
    left+=("the Docker engine ($engine_ours), running (--keep-engine); the next run adopts it")
  elif [ -n "$engine_ours" ]; then
    log "stopping the Docker engine it started ($engine_ours)"
    if [ "$engine_ours" = systemd ]; then
      systemctl stop docker.service docker.socket
    else
      local pid; pid="$(engine_pid)"
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && { log "dockerd did not stop: SIGKILL"; kill -KILL "$pid"; sleep 1; }
      # What dockerd leaves in /run: its default network namespace's mount, its state folder.
      local ns
      for ns in /run/docker/netns/*; do [ -e "$ns" ] && umount "$ns" 2>/dev/null; done
      rm -rf /run/docker /run/docker.pid /run/docker.sock
    fi
    rm -f "$state/engine"
    restore_network
    if [ "$keep_images" = 0 ] && [ -e "$state/docker-data-ours" ]; then
      log "removing Docker's data (/var/lib/docker), which the check created"
      rm -rf /var/lib/docker && rm -f "$state/docker-data-ours"
    elif [ -d /var/lib/docker ]; then
      left+=("Docker's data: /var/lib/docker ($(du -sh /var/lib/docker 2>/dev/null | cut -f1))")
    fi
  fi
  rm -rf "$run"
  if [ "$purge" = 1 ]; then
    if [ -s "$state/installed-packages" ]; then
      log "--purge: removing the packages it installed: $(tr '\n' ' ' <"$state/installed-packages")"
      mapfile -t packages <"$state/installed-packages"
      DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${packages[@]}" >/dev/null 2>&1
    fi
    rm -rf "$cache"
  else
    [ -s "$state/installed-packages" ] &&
      left+=("packages it installed (--purge removes them): $(tr '\n' ' ' <"$state/installed-packages")")
    [ -d "$cache" ] && left+=("its cache: $cache ($(du -sh "$cache" 2>/dev/null | cut -f1): Debian rootfs, torch index, client venv, dockerd log)")
  fi
  echo
  echo "=== summary ($(elapsed "$t_start") s in all)"
  local line
  for line in "${summary[@]}"; do echo "$line"; done
  [ -z "${build_summary:-}" ] || echo "image: $build_summary"
  [ -z "${scaling_summary:-}" ] || echo "scaling: $scaling_summary"
  echo "left on this machine:"
  [ "${#left[@]}" -gt 0 ] || echo "  nothing"
  for line in "${left[@]}"; do echo "  - $line"; done
  if [ "$rc" = 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
  exit "$rc"
}
