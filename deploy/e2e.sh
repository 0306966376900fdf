#!/usr/bin/env bash
# The operator's path, end to end, on a cluster of two hosts that this script makes on this machine:
#
#   laptop  this shell (the machine's network): `ray up`, the openai client, Prometheus
#           10.231.S.1 ──┐
#                        bridge (in the run's network namespace <run>-net; S picked per run)
#   head    10.231.S.2 ──┤ network namespace <run>-head: sshd :22, the Ray head (GCS :6379,
#                        │ dashboard 127.0.0.1:8265, metrics :8080), Serve's HTTP proxy on
#                        │ 127.0.0.1:30000 and the ingress; PD: the decode pool
#   worker  10.231.S.3 ──┘ network namespace <run>-worker: sshd :22, a Ray worker node (metrics
#                          :8080); the unified engine replica; PD: the prefill pool
#
# Steps: the hosts (namespaces, veths, one sshd each, a key made for this run) -> `ray up` of
# deploy/cluster.yaml with head_ip and worker_ips set to them (the head's autoscaler then sets up
# the worker over SSH: the same setup commands, then `ray start --address=<head>:6379` with the
# token that file_mounts copied from the head) -> `serve deploy` of deploy/serve.yaml -> a chat
# completion through the head's HTTP (an SSH tunnel, as `ray attach -p` makes) -> `serve deploy`
# of deploy/serve-pd.yaml: the prefill replica on the worker ships its KV to the decode replica
# on the head (gloo, 10.231.S.3 -> 10.231.S.2), checked by the replicas' byte counters in
# /get_server_info -> Prometheus with deploy/prometheus.yml scrapes the server and both nodes ->
# `ray down` (Ray's local provider stops the head's Ray only) and `ray stop` on the worker over
# SSH, as the README says -> no Ray process and no sshd in either host, the namespaces and veths
# gone.
#
# Where replicas go: every node advertises Ray's own `node:<address>` resource, so the run's copy
# of serve.yaml pins EngineReplica to `node:10.231.S.3` (as serve.yaml pins the ingress to the
# head with `node:__internal_head__`). For PD the nodes advertise the pools' custom resources
# (`ray start --resources`): the worker `prefill_pool`, the head `decode_pool`, which the prefill
# and decode replicas ask for (serve-pd.yaml's own `prefill_resources` / `decode_resources`). The
# head keeps its CPUs, since it holds the decode pool.
#
# Run from the repository root of a checkout whose .venv `make setup` made (it is the "laptop"):
#   bash deploy/e2e.sh
# Needs root (apt-get, sshd, namespaces). Exits non-zero on any failure; prints every step.
# About 12 minutes on 2 cores, up to 17 when other work shares them: each host's setup commands
# install the project into its own virtualenv (2-4.5 min each, one after the other: the worker's
# start once the head is up), two app deployments (~2 min each). E2E_TIMEOUT_S (default 1200)
# bounds the whole run.
#
# Each host is a network namespace with its own PID and mount namespaces: `ray stop` there sees
# only that host's processes; its home (/root), /etc/ssh and /tmp are its own (under the run's
# tmpfs), so each host's virtualenv, ~/.bashrc, ~/.ray/auth_token and Ray's /tmp/ray are its own and
# go with the run. Two directories are shared with the machine: the converted default model
# (~/.cache/radixserve) and torch's extension cache (~/.cache/torch_extensions), where the engines'
# first start builds the CPU kernels (minutes of g++ on a busy machine; once per source, and a
# suite run before this one has built them).
#
# Packages: the setup commands are deploy/cluster.yaml's, run with none of this machine's pip
# configuration (each host's sshd sets PIP_CONFIG_FILE=/dev/null). Everything comes from the
# public index except what RADIXSERVE_WHEEL_DIR names (default /opt/wheels, which the setup
# commands pass to pip as --find-links): the CPU-only torch wheel, instead of PyPI's with its
# CUDA libraries. The namespaces have no route out: their pip reaches PyPI through a CONNECT
# proxy that this script runs on 10.231.S.1, which admits pypi.org:443 and
# files.pythonhosted.org:443 only (PIP_PROXY). Nothing else is contacted but these namespaces.
#
# Where network namespaces cannot be made (`ip netns add` refused), the script says what failed
# and runs the head alone (sshd on 127.0.0.1, the cluster's ports moved to free ones, both pools
# on the head); it then ends with "E2E PASSED ON ONE HOST ONLY" and says that the worker path was
# not tested. E2E_ONE_HOST=1 asks for that mode.
#
# The whole run is in its own PID and mount namespaces (unshare): what is left when it ends, the
# kernel ends, and its mounts (the tmpfs, the namespaces' handles) go with it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAPTOP_VENV="$REPO/.venv"

step() { printf '\n== %s\n' "$*"; }
fail() { printf '\nE2E FAILED: %s\n' "$*" >&2; exit 1; }

if [ -z "${RADIXSERVE_E2E_INSIDE:-}" ]; then
  [ "$(id -u)" = 0 ] || fail "run as root (apt-get, sshd, namespaces)"
  [ -x "$LAPTOP_VENV/bin/ray" ] || fail "$LAPTOP_VENV/bin/ray missing: run \`make setup\` first"
  step "installing openssh-server, rsync, netcat-openbsd, prometheus, iproute2 (services not started)"
  bash "$REPO/deploy/apt-install.sh" openssh-server rsync netcat-openbsd prometheus iproute2
  step "entering private PID and mount namespaces"
  start=$(date +%s)
  set +e
  RADIXSERVE_E2E_INSIDE=1 timeout -k 30 "${E2E_TIMEOUT_S:-1200}" \
    unshare --pid --fork --kill-child=SIGTERM --mount-proc --propagation private bash "${BASH_SOURCE[0]}" "$@"
  rc=$?
  set -e
  [ $rc = 124 ] && echo "E2E FAILED: over E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-1200}s" >&2
  echo "e2e: exit $rc after $(( $(date +%s) - start ))s"
  exit $rc
fi

# ---- inside the namespaces: this shell is PID 1 -------------------------------------------------
PY="$LAPTOP_VENV/bin/python"
RAY="$LAPTOP_VENV/bin/ray"
RUN="$(mktemp -d /tmp/radixserve-e2e.XXXXXX)"
ID="$(basename "$RUN" | cut -d. -f2 | tr 'A-Z' 'a-z')"
CLUSTER="radixserve-e2e-$ID"
CONFIG="$RUN/cluster.yaml"
WHEEL_DIR="${RADIXSERVE_WHEEL_DIR:-/opt/wheels}"
NS_NET="rse2e-$ID-net" NS_HEAD="rse2e-$ID-head" NS_WORKER="rse2e-$ID-worker"
LAPTOP_IF="rse2e$ID"
HOSTS=()                  # the hosts of this run: head [worker]
declare -A HOST_PID=()    # host -> the pid of its `unshare` (its sshd is that one's child)
BG_PIDS=()                # the laptop's helpers: proxy, SSH tunnel, Prometheus
export RAY_USAGE_STATS_ENABLED=0
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -x -E "rse2e-$ID-(net|head|worker)" || true; }

host_pid1() { pgrep -P "${HOST_PID[$1]}" | head -n 1; }  # the host's sshd, PID 1 of its namespace
host_procs() {  # "pid comm" of every process in host $1's PID namespace but its sshd processes
  local pid1 ns p
  pid1=$(host_pid1 "$1") || return 0
  [ -n "$pid1" ] || return 0
  ns=$(readlink "/proc/$pid1/ns/pid") || return 0
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$ns" ] || continue
    local comm
    comm=$(cat "$p/comm" 2>/dev/null) || continue
    [ "$comm" = sshd ] || echo "${p#/proc/} $comm"
  done
}

stop_hosts() {  # what is left is checked by the caller
  local host ns pid1 killer
  for host in "${HOSTS[@]}"; do
    # Its sshd, PID 1 of its namespace: when it ends, the kernel ends the rest, and `unshare`
    # (which ignores TERM itself) returns. KILL if it has not ended within 15 s.
    [ -n "${HOST_PID[$host]:-}" ] || continue
    pid1=$(host_pid1 "$host")
    [ -z "$pid1" ] || kill "$pid1" 2>/dev/null || true
    ( sleep 15; kill -KILL "$pid1" "${HOST_PID[$host]}" 2>/dev/null ) &
    killer=$!
    wait "${HOST_PID[$host]}" 2>/dev/null || true
    kill "$killer" 2>/dev/null || true
    wait "$killer" 2>/dev/null || true
  done
  for ns in $(our_namespaces); do ip netns del "$ns" || true; done
  ip link del "$LAPTOP_IF" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  set +e
  if [ $rc != 0 ]; then
    step "failure: logs"
    tail -n 40 "$RUN"/head/tmp/ray/session_2*/logs/serve/controller_*.log 2>/dev/null
    tail -n 30 "$RUN"/head/tmp/ray/session_2*/logs/monitor.{out,err} 2>/dev/null
    tail -n 15 "$RUN"/worker/tmp/ray/session_2*/logs/raylet.out 2>/dev/null
    tail -n 10 "$RUN"/*/tmp/sshd.log "$RUN/proxy.log" 2>/dev/null
    [ -f "$CONFIG" ] && timeout 120 "$RAY" down -y "$CONFIG" >/dev/null 2>&1
  fi
  for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  stop_hosts 2>/dev/null
  # The laptop's home and the machine's caches are mounted inside $RUN: unmount first.
  umount -l /root 2>/dev/null
  umount -R -l "$RUN" 2>/dev/null
  if mountpoint -q "$RUN" || grep -q -F " $RUN/" /proc/self/mounts; then
    echo "e2e: something is still mounted at $RUN; leaving it in place" >&2
  else
    rm -rf --one-file-system "$RUN"
  fi
  # What `ray up` / `ray exec` leave on the laptop side: the cluster's state, its cached config,
  # its SSH control sockets' directory.
  rm -f "/tmp/ray/cluster-$CLUSTER.state" "/tmp/ray/cluster-$CLUSTER.lock"
  grep -l "\"cluster_name\": \"$CLUSTER\"" /tmp/ray-config-* 2>/dev/null | xargs -r rm -f
  rm -rf "/tmp/ray_ssh_$(printf %s "$(id -un)" | sha256sum | cut -c1-10)/$(printf %s "$CLUSTER" | sha256sum | cut -c1-10)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # PID 1 ignores signals it has no handler for: E2E_TIMEOUT_S, Ctrl-C

step "the run's files on a tmpfs ($RUN): the laptop's home and each host's home, /etc/ssh and /tmp"
# In memory: the hosts' virtualenvs install faster and go with one umount (no slow rm -rf).
mount -t tmpfs -o size=16g,mode=700 radixserve-e2e "$RUN"
mkdir -p "$RUN/laptop/home/.ssh" /root/.cache/radixserve /root/.cache/torch_extensions
# The laptop keeps the machine's Python for its .venv (a pyenv build); the converted model and the
# CPU kernels' builds are the machine's too, and the hosts share them.
for shared in .cache/radixserve .cache/torch_extensions .pyenv; do
  [ -d "/root/$shared" ] || continue
  mkdir -p "$RUN/laptop/home/$shared"
  mount --bind "/root/$shared" "$RUN/laptop/home/$shared"
done
SHARED_CACHES=(radixserve torch_extensions)
mount --rbind "$RUN/laptop/home" /root
ssh-keygen -q -t ed25519 -N "" -C "radixserve-e2e" -f "$RUN/id_ed25519"
SSH_OPTS=(-i "$RUN/id_ed25519" -o IdentitiesOnly=yes -o StrictHostKeyChecking=no
  -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=10)

ONE_HOST="${E2E_ONE_HOST:-}"
make_network() {  # the bridge, the laptop's veth into it, one veth per host namespace
  local s
  for s in $(shuf -i 1-254 -n 20); do
    ip -4 addr show | grep -q " 10\.231\.$s\." || ip -4 route show | grep -q "^10\.231\.$s\." || break
  done
  SUBNET="10.231.$s" LAPTOP_IP="10.231.$s.1" HEAD_IP="10.231.$s.2" WORKER_IP="10.231.$s.3"
  ip netns add "$NS_NET" || return 1
  ip -n "$NS_NET" link set lo up || return 1
  ip -n "$NS_NET" link add br0 type bridge || return 1
  ip -n "$NS_NET" link set br0 up || return 1
  ip link add "$LAPTOP_IF" type veth peer name laptop netns "$NS_NET" || return 1
  ip addr add "$LAPTOP_IP/24" dev "$LAPTOP_IF" || return 1
  ip link set "$LAPTOP_IF" up || return 1
  ip -n "$NS_NET" link set laptop master br0 up || return 1
  local host ns ip
  for host in head worker; do
    ns="rse2e-$ID-$host" ip=$([ $host = head ] && echo "$HEAD_IP" || echo "$WORKER_IP")
    ip netns add "$ns" || return 1
    ip -n "$ns" link set lo up || return 1
    ip -n "$NS_NET" link add "$host" type veth peer name eth0 netns "$ns" || return 1
    ip -n "$NS_NET" link set "$host" master br0 up || return 1
    ip -n "$ns" addr add "$ip/24" dev eth0 || return 1
    ip -n "$ns" link set eth0 up || return 1
  done
}
if [ -n "$ONE_HOST" ]; then
  NET_FAILURE="E2E_ONE_HOST=$ONE_HOST was set"
else
  step "network namespaces: $NS_NET (a bridge), $NS_HEAD, $NS_WORKER"
  # `ip netns add` leaves a file per namespace in /run/netns: on a tmpfs of this run's mount
  # namespace, they go with it however the run ends.
  mkdir -p /run/netns && mount -t tmpfs -o size=1m,mode=755 radixserve-e2e-netns /run/netns 2> "$RUN/netns.err"
  if ! make_network 2>> "$RUN/netns.err"; then
    NET_FAILURE="network namespaces could not be made: $(tr '\n' ' ' < "$RUN/netns.err")"
    ONE_HOST=1
    stop_hosts 2>/dev/null
  fi
fi
if [ -n "$ONE_HOST" ]; then
  echo "ONE HOST ONLY: $NET_FAILURE"
  echo "the head runs alone, on 127.0.0.1; the worker path will NOT be tested"
  HOSTS=(head) HEAD_IP=127.0.0.1 WORKER_IP="" SSH_PORT=$(free_port) PIP_PROXY=""
else
  HOSTS=(head worker) SSH_PORT=22
  ip -br addr show dev "$LAPTOP_IF"
  for ns in "$NS_HEAD" "$NS_WORKER"; do echo "$ns: $(ip -n "$ns" -br -4 addr show dev eth0)"; done

  step "a CONNECT proxy on $LAPTOP_IP for the hosts' pip: pypi.org:443 and files.pythonhosted.org:443 only"
  cat > "$RUN/pypi-proxy.py" <<'EOF'
import asyncio
import socket
import sys

ALLOWED = {("pypi.org", 443), ("files.pythonhosted.org", 443)}


async def pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def handle(reader, writer):
    peer = writer.get_extra_info("peername")[0]
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        method, target = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or not port.isdigit() or (host, int(port)) not in ALLOWED:
            print(f"refused {method} {target} from {peer}", flush=True)
            writer.write(b"HTTP/1.1 403 Forbidden\r\n\r\n")
            writer.close()
            return
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 30)
        print(f"CONNECT {target} from {peer}", flush=True)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
        print(f"error from {peer}: {exc!r}", flush=True)
        writer.close()


async def main():
    sock = socket.create_server((sys.argv[1], 0))
    server = await asyncio.start_server(handle, sock=sock)
    print(f"port {sock.getsockname()[1]}", flush=True)
    await server.serve_forever()


asyncio.run(main())
EOF
  "$PY" "$RUN/pypi-proxy.py" "$LAPTOP_IP" > "$RUN/proxy.log" 2>&1 &
  BG_PIDS+=($!)
  for _ in $(seq 50); do grep -q "^port " "$RUN/proxy.log" && break; sleep 0.2; done
  PIP_PROXY="http://$LAPTOP_IP:$(awk '/^port /{print $2; exit}' "$RUN/proxy.log")"
  echo "proxy at $PIP_PROXY"
fi

step "the hosts: ${HOSTS[*]}, each with its own home, /etc/ssh, /tmp and sshd on port $SSH_PORT"
[ -d "$WHEEL_DIR" ] || fail "RADIXSERVE_WHEEL_DIR=$WHEEL_DIR is not a directory"
echo "RADIXSERVE_WHEEL_DIR=$WHEEL_DIR: $(ls "$WHEEL_DIR" | tr '\n' ' ')"
cat > "$RUN/host-init.sh" <<'EOF'
# PID 1 of a host's PID namespace, in its own mount namespace: the host's own home, /etc/ssh and
# /tmp, then its sshd in the foreground (it reaps what its sessions leave).
set -e
mount --rbind "$1/home" /root
mount --bind "$1/etc-ssh" /etc/ssh
mount --bind "$1/tmp" /tmp
exec /usr/sbin/sshd -D -E /tmp/sshd.log
EOF
mkdir -p /run/sshd  # sshd's privilege-separation directory
start_host() {  # $1 host name, $2 address
  local h="$RUN/$1"
  mkdir -p "$h/home/.ssh" "$h/etc-ssh" "$h/tmp"
  chmod 700 "$h/home" "$h/home/.ssh"
  chmod 1777 "$h/tmp"
  cp "$RUN/id_ed25519.pub" "$h/home/.ssh/authorized_keys"
  chmod 600 "$h/home/.ssh/authorized_keys"
  touch "$h/home/.bashrc"
  local cache
  for cache in "${SHARED_CACHES[@]}"; do
    mkdir -p "$h/home/.cache/$cache"
    mount --bind "$RUN/laptop/home/.cache/$cache" "$h/home/.cache/$cache"
  done
  ssh-keygen -q -t ed25519 -N "" -f "$h/etc-ssh/ssh_host_ed25519_key"
  cat > "$h/etc-ssh/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress $2
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile none
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
Subsystem sftp internal-sftp
SetEnv PIP_CONFIG_FILE=/dev/null RADIXSERVE_WHEEL_DIR=$WHEEL_DIR${PIP_PROXY:+ PIP_PROXY=$PIP_PROXY}
EOF
  local netns=()
  [ -n "$ONE_HOST" ] || netns=(ip netns exec "rse2e-$ID-$1")
  "${netns[@]}" unshare --pid --fork --kill-child --mount-proc --propagation private \
    bash "$RUN/host-init.sh" "$h" > "$h/init.log" 2>&1 &
  HOST_PID[$1]=$!
}
ssh_host() { ssh "${SSH_OPTS[@]}" ${ONE_HOST:+-o "ProxyCommand=nc %h $SSH_PORT"} "root@$1" "${@:2}"; }
start_host head "$HEAD_IP"
[ -n "$ONE_HOST" ] || start_host worker "$WORKER_IP"
for host in "${HOSTS[@]}"; do
  ip=$([ "$host" = head ] && echo "$HEAD_IP" || echo "$WORKER_IP")
  for _ in $(seq 50); do ssh_host "$ip" true 2>/dev/null && break; sleep 0.2; done
  env=$(ssh_host "$ip" 'echo "addresses $(hostname -I| xargs), $(ls -d /proc/[0-9]* | wc -l) processes in its PID namespace, PIP_CONFIG_FILE=$PIP_CONFIG_FILE"') \
    || { cat "$RUN/$host/init.log" "$RUN/$host/tmp/sshd.log" 2>/dev/null; fail "no SSH to the $host at $ip"; }
  echo "$host at $ip:$SSH_PORT: root login by key works ($env)"
done

step "Ray's token for the cluster: ray get-auth-token --generate"
# README: ray get-auth-token --generate
"$RAY" get-auth-token --generate >/dev/null
test -s /root/.ray/auth_token

step "rendering $CONFIG from deploy/cluster.yaml, and serve.yaml / serve-pd.yaml (this run's hosts)"
if [ -n "$ONE_HOST" ]; then
  GCS_PORT=$(free_port) DASH_PORT=$(free_port) METRICS_PORT=$(free_port) HTTP_PORT=$(free_port)
else
  GCS_PORT=6379 DASH_PORT=8265 METRICS_PORT=8080 HTTP_PORT=30000  # the files' own: each host's ports are its own
fi
export RUN CLUSTER REPO HEAD_IP ONE_HOST SSH_PORT GCS_PORT DASH_PORT METRICS_PORT HTTP_PORT
export WORKER_IP="${WORKER_IP:-}"
"$PY" - <<'EOF'
import json, os, re, socket, yaml

env = os.environ
one_host = bool(env["ONE_HOST"])
def free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

c = yaml.safe_load(open(f"{env['REPO']}/deploy/cluster.yaml"))
c["cluster_name"] = env["CLUSTER"]
workers = [] if one_host else [env["WORKER_IP"]]
c["provider"].update(head_ip=env["HEAD_IP"], worker_ips=workers)
c["max_workers"] = len(workers)
c["auth"] = {"ssh_user": "root", "ssh_private_key": f"{env['RUN']}/id_ed25519"}
if one_host:  # Ray's SSH config has no port field: a ProxyCommand (netcat) reaches sshd's port
    c["auth"]["ssh_proxy_command"] = f"nc %h {env['SSH_PORT']}"
assert c["file_mounts"]["~/radixserve"] == "."
c["file_mounts"]["~/radixserve"] = env["REPO"]
for name in ("serve.yaml", "serve-pd.yaml", "placement.py"):
    c["file_mounts"][f"~/e2e-{name}"] = f"{env['RUN']}/{name}"

def resources(d: dict) -> str:
    return f" --resources='{json.dumps(d)}'"

def start_commands(key: str, extra: str, ports: dict[str, str]) -> list[str]:
    out = []
    for cmd in c[key]:
        if re.match(r"(\w+=\S*\s+)*ray start ", cmd):
            for a, b in ports.items():
                assert a in cmd, (a, cmd)
                cmd = cmd.replace(a, b)
            cmd += extra
        out.append(cmd)
    return out

if one_host:
    # The head shares the machine's network: every port a free one.
    ports = {"--port=6379": f"--port={env['GCS_PORT']}",
             "--metrics-export-port=8080": f"--metrics-export-port={env['METRICS_PORT']}"}
    extra = (f" --dashboard-port={env['DASH_PORT']} --ray-client-server-port={free()}"
             f" --dashboard-agent-listen-port={free()} --dashboard-agent-grpc-port={free()}"
             f" --runtime-env-agent-port={free()} --node-manager-port={free()}"
             f" --object-manager-port={free()} --node-ip-address={env['HEAD_IP']}" + resources({"prefill_pool": 1, "decode_pool": 1}))
    head = start_commands("head_start_ray_commands", extra, ports)
    # The autoscaler's and the dashboard's metrics ports are environment settings.
    c["head_start_ray_commands"] = [
        f"AUTOSCALER_METRIC_PORT={free()} DASHBOARD_METRIC_PORT={free()} {cmd}" if "ray start " in cmd else cmd
        for cmd in head
    ]
else:
    # No route out of a namespace, so no default route to find the head's own address by: named.
    # (A worker finds its own from the head's address.)
    c["head_start_ray_commands"] = start_commands(
        "head_start_ray_commands", f" --node-ip-address={env['HEAD_IP']}" + resources({"decode_pool": 1}), {})
    c["worker_start_ray_commands"] = start_commands(
        "worker_start_ray_commands", resources({"prefill_pool": 1}), {})
yaml.safe_dump(c, open(f"{env['RUN']}/cluster.yaml", "w"), sort_keys=False)

def render(name: str) -> dict:
    s = yaml.safe_load(open(f"{env['REPO']}/deploy/{name}"))
    s["http_options"]["port"] = int(env["HTTP_PORT"])
    (app,) = s["applications"]
    app["args"].update(port=int(env["HTTP_PORT"]), max_total_tokens=4096, num_threads=1)
    return s

def deployment(app: dict, name: str) -> dict:
    deps = app.setdefault("deployments", [])
    found = [d for d in deps if d["name"] == name]
    if not found:
        deps.append({"name": name})
    return found[0] if found else deps[-1]

s = render("serve.yaml")
(app,) = s["applications"]
if not one_host:  # the unified engine on the worker
    d = deployment(app, "EngineReplica")
    assert "ray_actor_options" not in d, d
    d["ray_actor_options"] = {"num_cpus": app["args"].get("replica_num_cpus", 1),
                              "resources": {f"node:{env['WORKER_IP']}": 0.01}}
yaml.safe_dump(s, open(f"{env['RUN']}/serve.yaml", "w"), sort_keys=False)

s = render("serve-pd.yaml")
(app,) = s["applications"]
args = app["args"]
for role in ("prefill", "decode"):  # the pools' resources, which the nodes advertise
    assert f"{role}_pool" in (args.get(f"{role}_resources") or {}), args
    print(f"serve-pd.yaml: {role}_resources {args[role + '_resources']}")
yaml.safe_dump(s, open(f"{env['RUN']}/serve-pd.yaml", "w"), sort_keys=False)
EOF
cat > "$RUN/placement.py" <<'EOF'
# On the head: the address of the node of every live Serve replica, by deployment and replica id;
# with the argument `nodes`, the addresses of the live nodes.
import json
import sys

from ray.util.state import list_actors, list_nodes

ips = {n.node_id: n.node_ip for n in list_nodes(filters=[("state", "=", "ALIVE")])}
if sys.argv[1:] == ["nodes"]:
    print("nodes:", " ".join(sorted(ips.values())))
    sys.exit(0)
out = {}
for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
    if a.name and a.name.startswith("SERVE_REPLICA::"):
        _, deployment, replica = a.name.split("::", 1)[1].split("#")
        out.setdefault(deployment, {})[replica] = ips.get(a.node_id)
print("placement:", json.dumps(out, sort_keys=True))
EOF
"$PY" -c "import yaml,sys; from ray.autoscaler._private.util import prepare_config, validate_config; validate_config(prepare_config(yaml.safe_load(open(sys.argv[1]))))" "$CONFIG"
grep -E "head_ip|worker_ips|^- 10|ssh_|ray start|find-links" "$CONFIG"

cd "$REPO"
step "ray up -y $CONFIG"
t0=$(date +%s)
ray_up() {
  # README: ray up -y deploy/cluster.yaml
  timeout 600 "$RAY" up -y --no-config-cache "$CONFIG" 2>&1 \
    | grep --line-buffered -v "is ignored: it is neither a file nor a directory"
}
if ! ray_up; then
  # Seen once in several runs on a busy machine: the head's raylet missed Ray's start-up deadline.
  echo "ray up failed; the head's Ray logs:"
  tail -n 15 "$RUN"/head/tmp/ray/session_2*/logs/{gcs_server,raylet}.out 2>/dev/null
  step "ray up again (it is idempotent: an operator's first move after a failed start)"
  ray_up || fail "ray up"
fi
echo "ray up took $(( $(date +%s) - t0 ))s"
on_head() {  # a command on the head, as `ray exec` runs it (a login shell over SSH)
  local rc=0
  timeout 180 "$RAY" exec "$CONFIG" "$1" > "$RUN/exec.out" 2>&1 || rc=$?
  grep -v -E "^(Loaded cached provider|Fetched IP|Warning: Permanently|Shared connection)|refers to a file|To ensure this mount|ClusterState: Loaded|Loaded cached provider|--no-config-cache" "$RUN/exec.out" || true
  return $rc
}
# README: ray exec deploy/cluster.yaml 'ray status'
on_head "ray status" | tee "$RUN/status.txt"
# The autoscaler's node list lags (and, for a head on 127.0.0.1, stays empty): Ray's own list.
t0=$(date +%s)
until on_head "python ~/e2e-placement.py nodes" > "$RUN/nodes.txt" && grep -q "nodes: [0-9]" "$RUN/nodes.txt"; do
  [ $(( $(date +%s) - t0 )) -lt 60 ] || { cat "$RUN/nodes.txt"; fail "Ray lists no live node"; }
  sleep 5
done
# The head's address as Ray gives it (for a head on 127.0.0.1 Ray takes the machine's own).
HEAD_NODE_IP=$(grep -o "nodes: .*" "$RUN/nodes.txt" | cut -d' ' -f2)
echo "Ray's live nodes: $HEAD_NODE_IP"
[ -n "$ONE_HOST" ] || [ "$HEAD_NODE_IP" = "$HEAD_IP" ] || fail "the head is not among Ray's live nodes at $HEAD_IP"

step "the cluster refuses a caller without its token (RAY_AUTH_MODE=disabled ray status at $HEAD_IP:$GCS_PORT)"
if RAY_AUTH_MODE=disabled timeout 60 "$RAY" status --address="$HEAD_IP:$GCS_PORT" > "$RUN/noauth.txt" 2>&1; then
  cat "$RUN/noauth.txt"; fail "ray status without the token succeeded"
fi
grep -i -m 3 -E "unauthenticated|authentication|token" "$RUN/noauth.txt" || { tail -n 5 "$RUN/noauth.txt"; fail "no authentication error"; }

SERVE_ADDR=""
[ -z "$ONE_HOST" ] || SERVE_ADDR="-a http://127.0.0.1:$DASH_PORT"
wait_app() {  # until `serve status` shows the app RUNNING with exactly deployments $2, within $1 s
  local t0 limit=$1
  t0=$(date +%s)
  # README: ray exec deploy/cluster.yaml 'serve status'
  until on_head "serve status $SERVE_ADDR" > "$RUN/serve-status.txt" && "$PY" - "$RUN/serve-status.txt" "$2" <<'EOF'
import re, sys, yaml

text = re.sub(r"\x1b\[[0-9;]*m", "", open(sys.argv[1]).read())  # `ray exec`'s colours
try:
    lines = text[text.index("proxies:"):].splitlines()
    status = yaml.safe_load("\n".join(l for l in lines if not l.startswith("Shared connection")))
except (ValueError, yaml.YAMLError):  # no "proxies:" yet, or not YAML: not ready
    sys.exit(1)
if not isinstance(status, dict):
    sys.exit(1)
app = (status.get("applications") or {}).get("radixserve") or {}
deps = app.get("deployments") or {}
if any(d.get("status") in ("UNHEALTHY", "DEPLOY_FAILED") for d in deps.values()) or app.get("status") == "DEPLOY_FAILED":
    print(text)
    sys.exit(2)
ok = app.get("status") == "RUNNING" and sorted(deps) == sorted(sys.argv[2].split(",")) \
    and all(d.get("status") == "HEALTHY" for d in deps.values())
sys.exit(0 if ok else 1)
EOF
  do
    [ $? = 2 ] && fail "serve deploy"
    [ $(( $(date +%s) - t0 )) -lt "$limit" ] || { cat "$RUN/serve-status.txt"; fail "the app was not RUNNING within ${limit}s"; }
    sleep 5
  done
  echo "RUNNING after $(( $(date +%s) - t0 ))s:"
  grep -E "^\s+(status|[A-Za-z]+Replica|Ingress):" "$RUN/serve-status.txt" | head -n 12
}

step "serve deploy ~/e2e-serve.yaml (deploy/serve.yaml, EngineReplica pinned to the worker)"
# README: ray exec deploy/cluster.yaml 'serve deploy ~/radixserve/deploy/serve.yaml'
# (the run's copy, at ~/e2e-serve.yaml)
on_head "serve deploy $SERVE_ADDR ~/e2e-serve.yaml"

if [ -z "$ONE_HOST" ]; then
  step "the head's autoscaler sets up the worker ($WORKER_IP) over SSH; waiting for 2 nodes"
  t0=$(date +%s)
  until on_head "python ~/e2e-placement.py nodes" > "$RUN/nodes.txt" \
      && grep -q "nodes: $HEAD_IP $WORKER_IP$" "$RUN/nodes.txt"; do
    [ $(( $(date +%s) - t0 )) -lt 480 ] || { cat "$RUN/nodes.txt"; on_head "ray status"; fail "the worker did not join within 480s"; }
    sleep 10
  done
  echo "the worker joined after $(( $(date +%s) - t0 ))s"
  on_head "ray status" | grep -E "local.cluster.node|CPU|_pool"
  cmp -s /root/.ray/auth_token <(ssh_host "$WORKER_IP" 'grep -q RAY_AUTH_MODE=token ~/.bashrc && cat ~/.ray/auth_token') \
    || fail "the worker has no token or no RAY_AUTH_MODE=token in its ~/.bashrc"
  echo "the worker holds the cluster's token (~/.ray/auth_token) and runs Ray with RAY_AUTH_MODE=token"
fi
wait_app 480 "EngineReplica,Ingress"

# The laptop reaches the head's 127.0.0.1:30000 through SSH, as `ray attach -p 30000` does.
if [ -n "$ONE_HOST" ]; then
  API_PORT=$HTTP_PORT
else
  API_PORT=$(free_port)
  ssh "${SSH_OPTS[@]}" -N -o ExitOnForwardFailure=yes -L "127.0.0.1:$API_PORT:127.0.0.1:$HTTP_PORT" "root@$HEAD_IP" &
  BG_PIDS+=($!)
fi
API="http://127.0.0.1:$API_PORT"

step "the app answers on the head: curl /v1/models"
# README: ray exec deploy/cluster.yaml 'curl -s http://127.0.0.1:30000/v1/models'
on_head "curl -s http://127.0.0.1:$HTTP_PORT/v1/models" | tee "$RUN/models.json"
grep -q '"object":"list"' "$RUN/models.json" || fail "/v1/models on the head"

placement() {  # prints the placement JSON of every Serve replica
  on_head "python ~/e2e-placement.py" | tee "$RUN/placement.txt" | grep -o "placement: .*" | cut -d' ' -f2-
}
completion() {
  "$PY" - "$API" "$1" <<'EOF'
import sys
from openai import OpenAI

client = OpenAI(base_url=f"{sys.argv[1]}/v1", api_key="unused", timeout=120, max_retries=0)
r = client.chat.completions.create(
    model=client.models.list().data[0].id,
    messages=[{"role": "user", "content": sys.argv[2]}],
    max_tokens=8,
)
print(f"{r.model}: {r.choices[0].message.content!r} ({r.usage.prompt_tokens} prompt tokens, "
      f"{r.usage.completion_tokens} completion tokens, {r.choices[0].finish_reason})")
assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
EOF
}

step "one chat completion through the openai client, at $API/v1 (the head's HTTP)"
for _ in $(seq 50); do curl -s -o /dev/null "$API/health" && break; sleep 0.2; done
completion "Say hello."
P=$(placement)
echo "replicas' nodes: $P"
"$PY" -c "
import json, sys
p = json.loads(sys.argv[1])
want = {'Ingress': sys.argv[2], 'EngineReplica': sys.argv[3]}
got = {d: sorted(set(r.values())) for d, r in p.items()}
assert got == {d: [ip] for d, ip in want.items()}, (got, want)
print('the ingress on the head (%s), the engine replica on the %s (%s)' % (sys.argv[2], 'head' if sys.argv[4] else 'worker', sys.argv[3]))
" "$P" "$HEAD_NODE_IP" "${WORKER_IP:-$HEAD_NODE_IP}" "$ONE_HOST" || fail "replica placement"

step "PD: serve deploy ~/e2e-serve-pd.yaml (deploy/serve-pd.yaml: prefill_pool on the ${WORKER_IP:+worker}${ONE_HOST:+head}, decode_pool on the head)"
on_head "serve deploy $SERVE_ADDR ~/e2e-serve-pd.yaml"
sleep 5  # the controller takes the new config before `serve status` reports it
wait_app 420 "DecodeReplica,Ingress,PrefillReplica"
for _ in $(seq 50); do curl -s -o /dev/null "$API/health" && break; sleep 0.2; done
completion "Write one sentence about the sea, then one about the mountains, then one about rivers."
P=$(placement)
echo "replicas' nodes: $P"
curl -s "$API/get_server_info" > "$RUN/server_info.json"
"$PY" - "$P" "$RUN/server_info.json" "$HEAD_NODE_IP" "${WORKER_IP:-$HEAD_NODE_IP}" <<'EOF' || fail "PD: the KV did not move between the hosts"
import json, sys

placement, info = json.loads(sys.argv[1]), json.load(open(sys.argv[2]))
head, worker = sys.argv[3], sys.argv[4]
nodes = {d: sorted(set(r.values())) for d, r in placement.items()}
assert nodes == {"Ingress": [head], "PrefillReplica": [worker], "DecodeReplica": [head]}, nodes
stats = {r["role"]: r for r in info["replicas"]}
assert sorted(stats) == ["decode", "prefill"], info["replicas"]
# the ingress reaches the replicas of both hosts over gRPC (`ray start`'s transport settings)
assert info["transport"] == "grpc", info["transport"]
p, d = stats["prefill"], stats["decode"]
assert placement["PrefillReplica"].get(p["replica_id"]) == worker, (p["replica_id"], placement)
assert placement["DecodeReplica"].get(d["replica_id"]) == head, (d["replica_id"], placement)
sent, received = p["pd_bytes_sent_total"], d["pd_bytes_received_total"]
print(f"prefill replica {p['replica_id']} at {worker}: {sent} KV bytes sent, {p['computed_tokens_total']} prompt tokens computed")
print(f"decode replica {d['replica_id']} at {head}: {received} KV bytes received, {d['generation_tokens_total']} tokens generated")
assert sent > 0 and received == sent, (sent, received)
EOF

step "Prometheus with deploy/prometheus.yml finds the cluster's nodes in the head's discovery file"
# As on a real head, but with the server through the tunnel, the head's discovery file as this
# run's head wrote it, and a 2 s scrape.
PROM_PORT=$(free_port)
export PROM_PORT API_PORT
"$PY" - <<'EOF2'
import os, yaml

env = os.environ
c = yaml.safe_load(open(f"{env['REPO']}/deploy/prometheus.yml"))
c["global"] = {"scrape_interval": "2s", "evaluation_interval": "2s"}
c["rule_files"] = [f"{env['REPO']}/deploy/{f}" for f in c["rule_files"]]
jobs = {j["job_name"]: j for j in c["scrape_configs"]}
jobs["radixserve"]["static_configs"] = [{"targets": [f"127.0.0.1:{env['API_PORT']}"]}]
(sd,) = jobs["ray"]["file_sd_configs"]
assert sd["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
# The head's file is a link, absolute inside the head, into its session directory.
link = f"{env['RUN']}/head/tmp/ray/prom_metrics_service_discovery.json"
sd["files"] = [f"{env['RUN']}/head{os.readlink(link)}"]
yaml.safe_dump(c, open(f"{env['RUN']}/prometheus.yml", "w"))
EOF2
promtool check config "$RUN/prometheus.yml" >/dev/null
prometheus --config.file="$RUN/prometheus.yml" --storage.tsdb.path="$RUN/prometheus" \
  --web.listen-address="127.0.0.1:$PROM_PORT" > "$RUN/prometheus.log" 2>&1 &
PROM_PID=$!
BG_PIDS+=($PROM_PID)
t0=$(date +%s)
until curl -s "http://127.0.0.1:$PROM_PORT/api/v1/targets" > "$RUN/targets.json" 2>/dev/null && "$PY" - "$RUN/targets.json" "$METRICS_PORT" "$HEAD_NODE_IP" "${WORKER_IP:-$HEAD_NODE_IP}" <<'EOF2'
import json, sys

targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets}
print("targets:", health)
nodes = {f"{ip}:{sys.argv[2]}" for ip in sys.argv[3:]}
ray = {inst for (job, inst), h in health.items() if job == "ray" and inst in nodes and h == "up"}
sys.exit(0 if ray == nodes and [h for (job, _), h in health.items() if job == "radixserve"] == ["up"] else 1)
EOF2
do
  [ $(( $(date +%s) - t0 )) -lt 120 ] || { tail -n 20 "$RUN/prometheus.log"; fail "Prometheus did not scrape the server and every node"; }
  sleep 3
done
kill "$PROM_PID"; wait "$PROM_PID" 2>/dev/null || true

step "ray down -y $CONFIG"
# README: ray down -y deploy/cluster.yaml
t0=$(date +%s)
timeout 300 "$RAY" down -y "$CONFIG" > "$RUN/down.out" 2>&1 || { tail -n 20 "$RUN/down.out"; fail "ray down"; }
tail -n 3 "$RUN/down.out"
nothing_left_on() {  # $1 host: within 60 s, no process but its sshd
  local deadline=$(( $(date +%s) + 60 ))
  while [ -n "$(host_procs "$1")" ]; do
    [ "$(date +%s)" -lt $deadline ] || { host_procs "$1"; fail "processes left on the $1"; }
    sleep 2
  done
}
step "nothing left running on the head: no Ray or Serve process (only its sshd)"
nothing_left_on head
echo "the head: no process but its sshd, $(( $(date +%s) - t0 ))s after ray down began"
if [ -z "$ONE_HOST" ]; then
  step "ray stop on the worker: with Ray's local provider, ray down stops the head's Ray only"
  # A worker's raylet exits a minute after losing its head; its log monitor never does.
  echo "left on the worker by ray down: $(host_procs worker | awk '{print $2}' | sort | uniq -c | xargs)"
  # README: ssh -i ~/.ssh/id_ed25519 ubuntu@10.0.0.2 '~/radixserve-venv/bin/ray stop'
  ssh_host "$WORKER_IP" '~/radixserve-venv/bin/ray stop' 2>&1 | tail -n 2 || true  # checked below
  nothing_left_on worker
  echo "the worker: no process but its sshd"
fi
for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
step "stopping the hosts' sshd; deleting the namespaces and the laptop's veth"
declare -A SSHD_PID=()
for host in "${HOSTS[@]}"; do SSHD_PID[$host]=$(host_pid1 "$host"); done
stop_hosts
for host in "${HOSTS[@]}"; do
  ! kill -0 "${SSHD_PID[$host]}" 2>/dev/null || fail "the $host's sshd (pid ${SSHD_PID[$host]}) is still running"
  ! kill -0 "${HOST_PID[$host]}" 2>/dev/null || fail "the $host's namespace holder (pid ${HOST_PID[$host]}) is still running"
done
[ -z "$(our_namespaces)" ] || fail "namespaces left: $(our_namespaces)"
deadline=$(( $(date +%s) + 30 ))
while ip link show "$LAPTOP_IF" >/dev/null 2>&1 || ip -br link | grep -q "rse2e$ID"; do
  [ "$(date +%s)" -lt $deadline ] || fail "the veth $LAPTOP_IF is still here"
  sleep 1
done
echo "no sshd, no namespace (rse2e-$ID-*), no veth of this run is left"
if [ -n "$ONE_HOST" ]; then
  step "E2E PASSED ON ONE HOST ONLY ($NET_FAILURE): the worker path and the KV across hosts were NOT tested"
else
  step "E2E PASSED (two hosts: head $HEAD_IP, worker $WORKER_IP)"
fi
