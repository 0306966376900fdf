#!/usr/bin/env bash
# The operator's path, end to end, on this one machine:
#   SSH server on 127.0.0.1 -> `ray up` of deploy/cluster.yaml (this machine as the head; the
#   setup commands make the node's virtualenv and install the project) -> `serve deploy` of
#   deploy/serve.yaml on the cluster -> one OpenAI chat completion -> Prometheus with
#   deploy/prometheus.yml scrapes the server and the nodes the head lists -> `ray down` ->
#   nothing left.
# Run from the repository root of a checkout whose .venv `make setup` made (it is the "laptop"):
#   bash deploy/e2e.sh
# Needs root (apt-get, sshd, namespaces). Exits non-zero on any failure; prints every step.
# About 4-5 minutes on 2 busy cores (`ray up`, which installs the project into the node's
# virtualenv, ~2; the app's first start with its kernel build, ~1); E2E_TIMEOUT_S (default 1200)
# bounds it.
#
# Isolation, so that it is idempotent and safe beside other Ray instances on the machine:
#  - `ray down` (and the config's own start commands) run `ray stop`, which stops every Ray
#    process it can see. The script runs in its own PID namespace (unshare), where it sees only
#    the processes of this run; when the run ends, the kernel ends whatever is left in it.
#  - Root's home seen by the run (the "laptop" and, over SSH, the "node") is a fresh tmpfs
#    mounted over /root in a private mount namespace: the node's virtualenv, ~/.bashrc,
#    ~/.ssh/authorized_keys, Ray's token and the node's kernel builds live and die with the run.
#    Three directories are the machine's: ~/.cache/radixserve (the converted default model),
#    ~/.config/pip (where this machine's pip finds packages) and ~/.pyenv (a pyenv-built Python,
#    which the laptop's .venv may use).
#  - Every port (sshd, GCS, dashboard, metrics, Serve's HTTP) is a free one, not the defaults.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAPTOP_VENV="$REPO/.venv"

step() { printf '\n== %s\n' "$*"; }
fail() { printf '\nE2E FAILED: %s\n' "$*" >&2; exit 1; }

if [ -z "${RADIXSERVE_E2E_INSIDE:-}" ]; then
  [ "$(id -u)" = 0 ] || fail "run as root (apt-get, sshd, namespaces)"
  [ -x "$LAPTOP_VENV/bin/ray" ] || fail "$LAPTOP_VENV/bin/ray missing: run \`make setup\` first"
  step "installing openssh-server, rsync, netcat-openbsd, prometheus (services not started)"
  bash "$REPO/deploy/apt-install.sh" openssh-server rsync netcat-openbsd prometheus
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
CLUSTER="radixserve-e2e-$(basename "$RUN" | cut -d. -f2)"
CONFIG="$RUN/cluster.yaml"
SHARED_DIRS=(.cache/radixserve .config/pip .pyenv)
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cleanup() {
  local rc=$?
  set +e
  if [ $rc != 0 ]; then
    step "failure: logs"
    tail -n 40 "$RUN"/ray/session_latest/logs/serve/controller_*.log 2>/dev/null
    tail -n 20 "$RUN/sshd.log" 2>/dev/null
    [ -f "$CONFIG" ] && timeout 120 "$RAY" down -y "$CONFIG" >/dev/null 2>&1
  fi
  [ -f "$RUN/sshd.pid" ] && kill "$(cat "$RUN/sshd.pid")" 2>/dev/null
  # The machine's ~/.cache and ~/.pyenv are mounted inside $RUN: unmount before removing.
  umount -l /root 2>/dev/null
  local shared mounted=0
  for shared in "${SHARED_DIRS[@]}"; do
    umount -l "$RUN/home/$shared" 2>/dev/null
    mountpoint -q "$RUN/home/$shared" && mounted=1
  done
  umount -l "$RUN/home" 2>/dev/null
  if [ $mounted = 1 ] || mountpoint -q "$RUN/home"; then
    echo "e2e: something is still mounted under $RUN; leaving $RUN in place" >&2
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

step "a fresh home for root ($RUN/home, a tmpfs), sharing the machine's ${SHARED_DIRS[*]}"
# In memory: the node's virtualenv installs faster and goes with one umount (no slow rm -rf).
mkdir -p "$RUN/home"
mount -t tmpfs -o size=8g,mode=700 radixserve-e2e "$RUN/home"
mkdir -p "$RUN/home/.ssh" /root/.cache/radixserve
for shared in "${SHARED_DIRS[@]}"; do
  [ -d "/root/$shared" ] || continue
  mkdir -p "$RUN/home/$shared"
  mount --bind "/root/$shared" "$RUN/home/$shared"
done
touch "$RUN/home/.bashrc"
chmod 700 "$RUN/home" "$RUN/home/.ssh"
mount --rbind "$RUN/home" /root

step "SSH server on 127.0.0.1 (a key made for this run, authorized for root)"
SSH_PORT=$(free_port)
ssh-keygen -q -t ed25519 -N "" -C "radixserve-e2e" -f "$RUN/id_ed25519"
ssh-keygen -q -t ed25519 -N "" -f "$RUN/ssh_host_ed25519_key"
cp "$RUN/id_ed25519.pub" /root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
cat > "$RUN/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $RUN/ssh_host_ed25519_key
PidFile $RUN/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile /root/.ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
Subsystem sftp internal-sftp
EOF
mkdir -p /run/sshd  # sshd's privilege-separation directory
/usr/sbin/sshd -t -f "$RUN/sshd_config"
/usr/sbin/sshd -f "$RUN/sshd_config" -E "$RUN/sshd.log"
# Ray's SSH config has no port field: a ProxyCommand (netcat) reaches sshd's port instead.
PROXY="nc %h $SSH_PORT"
ssh -i "$RUN/id_ed25519" -o IdentitiesOnly=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
  -o LogLevel=ERROR -o "ProxyCommand=$PROXY" -o ConnectTimeout=10 root@127.0.0.1 true
echo "sshd on 127.0.0.1:$SSH_PORT (pid $(cat "$RUN/sshd.pid")), root login by key works"

step "Ray's token for the cluster: ray get-auth-token --generate"
# README: ray get-auth-token --generate
"$RAY" get-auth-token --generate >/dev/null
test -s /root/.ray/auth_token

step "rendering $CONFIG from deploy/cluster.yaml and deploy/serve.yaml (this run's IPs, key, ports)"
GCS_PORT=$(free_port); DASH_PORT=$(free_port); METRICS_PORT=$(free_port); HTTP_PORT=$(free_port)
export RUN CLUSTER SSH_PORT PROXY GCS_PORT DASH_PORT METRICS_PORT HTTP_PORT REPO
"$PY" - <<'EOF'
import os, socket, yaml

env = os.environ
def free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

c = yaml.safe_load(open(f"{env['REPO']}/deploy/cluster.yaml"))
c["cluster_name"] = env["CLUSTER"]
c["provider"].update(head_ip="127.0.0.1", worker_ips=[])  # one machine: the head only
c["max_workers"] = 0
c["auth"] = {"ssh_user": "root", "ssh_private_key": f"{env['RUN']}/id_ed25519",
             "ssh_proxy_command": env["PROXY"]}
assert c["file_mounts"]["~/radixserve"] == "."
c["file_mounts"]["~/radixserve"] = env["REPO"]
c["file_mounts"]["~/e2e-serve.yaml"] = f"{env['RUN']}/serve.yaml"
ports = {"--port=6379": f"--port={env['GCS_PORT']}",
         "--metrics-export-port=8080": f"--metrics-export-port={env['METRICS_PORT']}"}
extra = (f" --dashboard-port={env['DASH_PORT']} --ray-client-server-port={free()}"
         f" --dashboard-agent-listen-port={free()} --dashboard-agent-grpc-port={free()}"
         f" --runtime-env-agent-port={free()} --node-manager-port={free()} --object-manager-port={free()}"
         f" --temp-dir={env['RUN']}/ray")
start = []
for cmd in c["head_start_ray_commands"]:
    if cmd.startswith("ray start"):
        for a, b in ports.items():
            assert a in cmd, (a, cmd)
            cmd = cmd.replace(a, b)
        # The autoscaler's and the dashboard's metrics ports are environment settings.
        cmd = f"AUTOSCALER_METRIC_PORT={free()} DASHBOARD_METRIC_PORT={free()} {cmd}{extra}"
    start.append(cmd)
c["head_start_ray_commands"] = start
yaml.safe_dump(c, open(f"{env['RUN']}/cluster.yaml", "w"), sort_keys=False)

s = yaml.safe_load(open(f"{env['REPO']}/deploy/serve.yaml"))
s["http_options"]["port"] = int(env["HTTP_PORT"])
(app,) = s["applications"]
app["args"].update(port=int(env["HTTP_PORT"]), max_total_tokens=4096, num_threads=1)
yaml.safe_dump(s, open(f"{env['RUN']}/serve.yaml", "w"), sort_keys=False)
EOF
"$PY" -c "import yaml,sys; from ray.autoscaler._private.util import prepare_config, validate_config; validate_config(prepare_config(yaml.safe_load(open(sys.argv[1]))))" "$CONFIG"
grep -E "head_ip|ssh_|ray start" "$CONFIG"

cd "$REPO"
step "ray up -y $CONFIG"
t0=$(date +%s)
ray_up() {
  # README: ray up -y deploy/cluster.yaml
  timeout 900 "$RAY" up -y --no-config-cache "$CONFIG" 2>&1 \
    | grep --line-buffered -v "is ignored: it is neither a file nor a directory"
}
if ! ray_up; then
  # Seen once in several runs on a busy machine: the head's raylet missed Ray's start-up deadline.
  echo "ray up failed; the head's Ray logs:"
  tail -n 15 "$RUN"/ray/session_latest/logs/{gcs_server,raylet}.out 2>/dev/null
  step "ray up again (it is idempotent: an operator's first move after a failed start)"
  ray_up || fail "ray up"
fi
echo "ray up took $(( $(date +%s) - t0 ))s"
on_head() {  # a command on the head, as `ray exec` runs it (a login shell over SSH)
  local rc=0
  timeout 180 "$RAY" exec "$CONFIG" "$1" > "$RUN/exec.out" 2>&1 || rc=$?
  grep -v -E "^(Loaded cached provider|Fetched IP|Warning: Permanently|Shared connection)" "$RUN/exec.out" || true
  return $rc
}
# README: ray exec deploy/cluster.yaml 'ray status'
# (with this run's GCS port: the run's Ray keeps its files under its own --temp-dir)
on_head "ray status --address=127.0.0.1:$GCS_PORT" | tee "$RUN/status.txt"
grep -q "1 local.cluster.node" "$RUN/status.txt" || fail "the head is not in ray status"

step "the cluster refuses a caller without its token (RAY_AUTH_MODE=disabled ray status)"
if RAY_AUTH_MODE=disabled timeout 60 "$RAY" status --address="127.0.0.1:$GCS_PORT" > "$RUN/noauth.txt" 2>&1; then
  cat "$RUN/noauth.txt"; fail "ray status without the token succeeded"
fi
grep -i -m 3 -E "unauthenticated|authentication|token" "$RUN/noauth.txt" || { tail -n 5 "$RUN/noauth.txt"; fail "no authentication error"; }

step "serve deploy ~/e2e-serve.yaml (deploy/serve.yaml with this run's port), then wait for RUNNING"
# README: ray exec deploy/cluster.yaml 'serve deploy ~/radixserve/deploy/serve.yaml'
# README: ray exec deploy/cluster.yaml 'serve status'
# (serve.yaml with this run's HTTP port, at ~/e2e-serve.yaml; the dashboard on this run's port)
on_head "serve deploy -a http://127.0.0.1:$DASH_PORT ~/e2e-serve.yaml"
t0=$(date +%s)
until on_head "serve status -a http://127.0.0.1:$DASH_PORT" > "$RUN/serve-status.txt" \
    && grep -q "status: RUNNING" "$RUN/serve-status.txt" \
    && ! grep -q -E "status: (DEPLOYING|UNHEALTHY|DEPLOY_FAILED)" "$RUN/serve-status.txt"; do
  grep -q -E "DEPLOY_FAILED|UNHEALTHY" "$RUN/serve-status.txt" && { cat "$RUN/serve-status.txt"; fail "serve deploy"; }
  [ $(( $(date +%s) - t0 )) -lt 420 ] || { cat "$RUN/serve-status.txt"; fail "the app was not RUNNING within 420s"; }
  sleep 5
done
cat "$RUN/serve-status.txt"

step "the app answers on the head: curl /v1/models"
# README: ray exec deploy/cluster.yaml 'curl -s http://127.0.0.1:30000/v1/models'
on_head "curl -s http://127.0.0.1:$HTTP_PORT/v1/models" | tee "$RUN/models.json"
grep -q '"object":"list"' "$RUN/models.json" || fail "/v1/models on the head"

step "one chat completion through the openai client, at http://127.0.0.1:$HTTP_PORT/v1"
"$PY" - <<EOF
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:$HTTP_PORT/v1", api_key="unused", timeout=120, max_retries=0)
r = client.chat.completions.create(
    model=client.models.list().data[0].id,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=8,
)
print(f"{r.model}: {r.choices[0].message.content!r} ({r.usage.completion_tokens} tokens, {r.choices[0].finish_reason})")
assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
EOF

step "Prometheus with deploy/prometheus.yml finds the cluster's nodes in the head's discovery file"
# As on a real head, but for this run's ports and Ray temp dir, and a 2 s scrape.
PROM_PORT=$(free_port)
export PROM_PORT
"$PY" - <<'EOF2'
import os, yaml

env = os.environ
c = yaml.safe_load(open(f"{env['REPO']}/deploy/prometheus.yml"))
c["global"] = {"scrape_interval": "2s", "evaluation_interval": "2s"}
c["rule_files"] = [f"{env['REPO']}/deploy/{f}" for f in c["rule_files"]]
jobs = {j["job_name"]: j for j in c["scrape_configs"]}
jobs["radixserve"]["static_configs"] = [{"targets": [f"127.0.0.1:{env['HTTP_PORT']}"]}]
(sd,) = jobs["ray"]["file_sd_configs"]
assert sd["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
sd["files"] = [f"{env['RUN']}/ray/prom_metrics_service_discovery.json"]
yaml.safe_dump(c, open(f"{env['RUN']}/prometheus.yml", "w"))
EOF2
promtool check config "$RUN/prometheus.yml" >/dev/null
prometheus --config.file="$RUN/prometheus.yml" --storage.tsdb.path="$RUN/prometheus" \
  --web.listen-address="127.0.0.1:$PROM_PORT" > "$RUN/prometheus.log" 2>&1 &
PROM_PID=$!
t0=$(date +%s)
until curl -s "http://127.0.0.1:$PROM_PORT/api/v1/targets" > "$RUN/targets.json" 2>/dev/null && "$PY" - "$RUN/targets.json" "$METRICS_PORT" <<'EOF2'
import json, sys

targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
health = {(t["labels"]["job"], t["labels"]["instance"].rsplit(":", 1)[1]): t["health"] for t in targets}
print("targets:", health)
ray = [h for (job, port), h in health.items() if job == "ray" and port == sys.argv[2]]
sys.exit(0 if ray == ["up"] and [h for (job, _), h in health.items() if job == "radixserve"] == ["up"] else 1)
EOF2
do
  [ $(( $(date +%s) - t0 )) -lt 120 ] || { tail -n 20 "$RUN/prometheus.log"; fail "Prometheus did not scrape both jobs"; }
  sleep 3
done
kill "$PROM_PID"; wait "$PROM_PID" 2>/dev/null || true

step "ray down -y $CONFIG"
# README: ray down -y deploy/cluster.yaml
timeout 300 "$RAY" down -y "$CONFIG" 2>&1 | tail -n 3
step "nothing left running: no Ray or Serve process, then sshd stopped"
deadline=$(( $(date +%s) + 60 ))
while pgrep -a -f "raylet|gcs_server|ray::|dashboard.py|monitor.py|ServeController|ServeReplica" >/dev/null; do
  [ "$(date +%s)" -lt $deadline ] || { pgrep -a -f "raylet|gcs_server|ray::"; fail "Ray processes left after ray down"; }
  sleep 1
done
kill "$(cat "$RUN/sshd.pid")"
deadline=$(( $(date +%s) + 30 ))
while pgrep -x sshd >/dev/null; do
  [ "$(date +%s)" -lt $deadline ] || fail "sshd still running"
  sleep 1
done
rm -f "$RUN/sshd.pid"
echo "no raylet, gcs_server, Serve or sshd process is left"
step "E2E PASSED"
