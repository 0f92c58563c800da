#!/usr/bin/env bash
# A one-node SLURM cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) and a Ray head on this
# machine, on 127.0.0.1, for `make test-cluster` (tests/cluster/).
#   bash scripts/cluster.sh up       install what is missing, start what is not running, wait
#   bash scripts/cluster.sh status   one line per service; exit status 0 when all run, else 3
#   bash scripts/cluster.sh down     stop exactly the processes `up` started
# Everything (configs, keys, databases, logs, pid files) lives under CLUSTER_DIR (default
# /tmp/amp-runner-cluster); nothing is exported: clients read CLUSTER_DIR/env (SLURM_CONF,
# RAY_ADDRESS, ...). Root only: slurmd runs jobs as their users, the daemons run as root.
#   CLUSTER_DIR   where it all lives          VENV  the Python environment Ray goes into (.venv)
#   CLUSTER_CPUS  CPUs the node offers (default: this machine's, from `slurmd -C`); more than the
#                 machine has lets more 1-CPU jobs run at once (slurmd then trusts the config)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CLUSTER_DIR=${CLUSTER_DIR:-/tmp/amp-runner-cluster}
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
CD=$CLUSTER_DIR
ETC=$CD/etc
PIDS=$CD/pids
LOG=$CD/log
CONF=$ETC/slurm.conf
CLUSTER_NAME=amprunner
PARTITION=debug
export PATH=$PATH:/usr/sbin:/sbin
# Ray maps 127.0.0.1 to this machine's outward address unless told the cluster is this machine
# alone; servers and clients both need it (it is in CLUSTER_DIR/env).
# and without token authentication: Ray 2.5x turns it on for a head started where a token file
# (~/.ray/auth_token) exists, which any local ray.init() writes, and a client whose mode is unset
# is then refused ("InvalidAuthToken"); this cluster listens on 127.0.0.1 only
RAY_LOCAL=(env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled)

die() { echo "cluster.sh: $*" >&2; exit 1; }
line() { printf '%-10s %s\n' "$1" "$2"; }

# --- processes: a pid counts as ours only while its command line or environment names
# CLUSTER_DIR (a pid file outlives its process; the pid may be another's by now) ---------------
alive() {  # alive PID: the process runs and is one of ours
  [ -n "${1:-}" ] && [ -r "/proc/$1/cmdline" ] || return 1
  tr '\0' '\n' 2>/dev/null <"/proc/$1/cmdline" | grep -qF -- "$CD" && return 0
  tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | grep -qxF -- "SLURM_CONF=$CONF"
}
pid_of() { cat "$PIDS/$1.pid" 2>/dev/null || true; }
running() { alive "$(pid_of "$1")"; }
session_pids() {  # session_pids SID [NAME]: the processes in session SID (named NAME)
  [ -n "${1:-}" ] || return 0
  ps -eo pid=,sid=,comm= | awk -v s="$1" -v n="${2:-}" '$2 == s && (n == "" || $3 == n) {print $1}'
}
gone() {  # gone PID: exited (a zombie counts: this machine's init may reap it only seconds later)
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }  # the state follows the command's name, which is in parentheses
  [ "${stat:0:1}" = Z ]
}
job_leftovers() {  # the job steps of our slurmd that outlived the cancellation, with their tasks
  local p steps=""
  for p in $(ps -eo pid=,comm= | awk '$2 == "slurmstepd" {print $1}'); do
    # our slurmd's steps: started by it, they have its environment, SLURM_CONF included
    tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF -- "SLURM_CONF=$CONF" && steps="$steps $p"
  done
  [ -n "$steps" ] || return 0
  ps -eo pid=,ppid= | awk -v roots="$steps" '
    { parent[$1] = $2 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) mine[r[i]] = 1
      do { more = 0; for (p in parent) if (!(p in mine) && (parent[p] in mine)) { mine[p] = 1; more = 1 } } while (more)
      for (p in mine) print p
    }'
}
stop_pids() {  # stop_pids SECONDS PID...: SIGTERM, then SIGKILL what is left after SECONDS
  local deadline=$((SECONDS + $1)) p left; shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  while [ "$SECONDS" -lt "$deadline" ]; do
    left=""
    for p in "$@"; do gone "$p" || left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -KILL $left 2>/dev/null || true
}
until_ok() {  # until_ok SECONDS COMMAND...: retry COMMAND until it succeeds; 1 if it never did
  local deadline=$((SECONDS + $1)); shift
  while [ "$SECONDS" -lt "$deadline" ]; do
    if declare -F "$1" >/dev/null; then
      "$@" >/dev/null 2>&1 && return 0  # a function here: the commands in it have timeouts
    elif timeout 10 "$@" >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}
wait_for() {  # wait_for SECONDS WHAT COMMAND...: until_ok, or stop saying WHAT did not come up
  local secs=$1 what=$2; shift 2
  until_ok "$secs" "$@" || die "$what did not come up within $secs s (logs: $LOG)"
}

# --- install ---------------------------------------------------------------------------------
install_debian() {
  local need=() created_policy=""
  command -v munged >/dev/null || need+=(munge)
  command -v mariadbd >/dev/null || need+=(mariadb-server)
  command -v slurmdbd >/dev/null || need+=(slurmdbd)
  command -v slurmctld >/dev/null || need+=(slurmctld)
  command -v slurmd >/dev/null || need+=(slurmd)
  command -v sbatch >/dev/null || need+=(slurm-client)
  [ ${#need[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "needs ${need[*]} and this machine has no apt-get: install them by hand"
  echo "installing ${need[*]} (apt-get)"
  # Their install scripts would start system-wide munge and MariaDB services; this script runs
  # its own. Keep them from starting, with the policy file invoke-rc.d reads, unless there is one.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT  # gone again however apt-get ends
    printf '#!/bin/sh\n# cluster.sh: no service starts while it installs packages\nexit 101\n' \
      >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    created_policy=1
  fi
  local ok=1
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
      >"$LOG/apt.log" 2>&1; then
    # a fresh machine's package lists may be empty or stale
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"$LOG/apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
        >>"$LOG/apt.log" 2>&1 || ok=""
  fi
  if [ -n "$created_policy" ]; then
    rm -f /usr/sbin/policy-rc.d
    trap - EXIT
  fi
  [ -n "$ok" ] || die "apt-get install ${need[*]} failed: $(tail -1 "$LOG/apt.log")"
}

install_ray() {
  local py=$VENV/bin/python before after pin
  [ -x "$py" ] || die "no Python environment at $VENV: run 'make setup' (or set VENV)"
  # pyproject.toml's `ray` extra, checked by its requirements and pip check (installed alone, the
  # launcher's cloudpickle<3 once broke joblib's cloudpickle>=3, and `make setup` undid it)
  if "$py" - >/dev/null 2>&1 <<'EOF'; then return 0; fi
import subprocess, sys, tomllib
from importlib.metadata import version

from packaging.requirements import Requirement

for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["ray"]:
    req = Requirement(line)
    assert req.specifier.contains(version(req.name), prereleases=True), line
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
sys.exit(check.returncode)
EOF
  # With the project, so pip resolves the extra and the project's own requirements together; and
  # without touching the environment's torch: pip must fail rather than replace it.
  echo "installing the project's ray extra into $VENV (pip install -e '.[ray]')"
  pin=$(mktemp)
  before=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
  [ -n "$before" ] && echo "torch==$before" >"$pin"
  if ! "$py" -m pip install -qq --disable-pip-version-check -c "$pin" -e ".[ray]" >"$LOG/pip.log" 2>&1; then
    rm -f "$pin"
    die "pip could not install the ray extra into $VENV: $(grep -m1 ERROR "$LOG/pip.log" || tail -1 "$LOG/pip.log")"
  fi
  rm -f "$pin"
  after=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
  [ "$before" = "$after" ] || die "installing Ray changed torch from $before to $after"
  "$py" -m pip check >"$LOG/pip-check.log" 2>&1 ||
    die "the ray extra left the environment inconsistent: $(grep -v 'is ignored' "$LOG/pip-check.log" | head -1)"
}

# --- configuration (written while nothing of ours runs; ports chosen afresh) -------------------
free_ports() {  # free_ports N: N distinct free TCP ports on 127.0.0.1
  "$VENV/bin/python" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_configs() {
  local node hw cpus mem ports
  node=$(hostname -s)
  # this machine as slurmd sees it: CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ...
  hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ *$//')
  cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  local overrides=""
  if [ -n "${CLUSTER_CPUS:-}" ] && [ "$CLUSTER_CPUS" != "$cpus" ]; then
    hw="CPUs=$CLUSTER_CPUS RealMemory=$mem"
    cpus=$CLUSTER_CPUS
    overrides="SlurmdParameters=config_overrides"
  fi
  read -r P_CTLD P_SLURMD P_DBD P_MYSQL P_RAY P_RAY_DASH P_RAY_AGENT <<<"$(free_ports 7)"
  cat >"$CD/ports" <<EOF
P_CTLD=$P_CTLD P_SLURMD=$P_SLURMD P_DBD=$P_DBD P_MYSQL=$P_MYSQL
P_RAY=$P_RAY P_RAY_DASH=$P_RAY_DASH P_RAY_AGENT=$P_RAY_AGENT
EOF
  [ -s "$CD/mysql/slurm.pass" ] || (umask 077; "$VENV/bin/python" -c 'import secrets; print(secrets.token_hex(16))' >"$CD/mysql/slurm.pass")
  : >"$ETC/plugstack.conf"  # no SPANK plugins (not the system's /etc/slurm/plugstack.conf)
  cat >"$CONF" <<EOF
# Written by scripts/cluster.sh: a one-node cluster on 127.0.0.1 for the tests.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$P_CTLD
SlurmdPort=$P_SLURMD
# bind to the address the names resolve to (127.0.0.1), not to every interface
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# the private munged; cred_expire is also how long a requeued job waits before it may run again
# (default 120 s; 5 is the least, 10 leaves a loaded machine time to launch a step)
AuthInfo=socket=$CD/munge/munge.socket,cred_expire=10
StateSaveLocation=$CD/slurm/state
SlurmdSpoolDir=$CD/slurm/spool
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$ETC/plugstack.conf
# no cgroups or systemd in a container: track job processes through /proc, bind no CPUs
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
MpiDefault=none
# cores and memory are what a job consumes, so several 1-CPU jobs share the node; a job that
# asks for no memory gets DefMemPerCPU, not the whole node (which would run jobs one at a time)
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
# A job becomes eligible later (a requeued one after cred_expire) without an event that runs the
# scheduler: it starts at the next periodic pass, every 60 s (main) and 30 s (backfill) by default
SchedulerParameters=sched_interval=2,bf_interval=1
# the tests wait on the cluster: short timeouts, a quick kill, finished jobs leave squeue soon
# (sacct keeps them)
MessageTimeout=5
KillWait=2
MinJobAge=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
JobRequeue=1
# a node that was down (the machine restarted) returns when its slurmd registers
ReturnToService=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$P_DBD
# clients reach slurmdbd through this munged too (the default is the system's socket)
AccountingStoragePass=$CD/munge/munge.socket
JobAcctGatherFrequency=10
$overrides
NodeName=$node NodeHostname=$node NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  (
    umask 077  # slurmdbd refuses a config others can read (it holds the database password)
    cat >"$ETC/slurmdbd.conf" <<EOF
# Written by scripts/cluster.sh
AuthType=auth/munge
AuthInfo=socket=$CD/munge/munge.socket
DbdHost=$node
DbdAddr=127.0.0.1
DbdPort=$P_DBD
SlurmUser=root
PidFile=$PIDS/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$P_MYSQL
StorageUser=slurm
StoragePass=$(cat "$CD/mysql/slurm.pass")
StorageLoc=slurm_acct_db
EOF
  )
}

# --- services ---------------------------------------------------------------------------------
munge_ok() { munge -n -S "$CD/munge/munge.socket" | unmunge -S "$CD/munge/munge.socket"; }
start_munge() {
  # munged wants its socket's folder open to all and its key readable by root alone
  [ -s "$CD/munge/munge.key" ] || mungekey --create --keyfile="$CD/munge/munge.key"
  chmod 600 "$CD/munge/munge.key"
  munged --socket="$CD/munge/munge.socket" --key-file="$CD/munge/munge.key" \
    --pid-file="$PIDS/munge.pid" --log-file="$LOG/munged.log" --seed-file="$CD/munge/munged.seed"
  wait_for 20 munged munge_ok
}

mysql_cli() { mariadb --no-defaults --socket="$CD/mysql/mysqld.sock" -u root "$@"; }
start_mariadb() {
  if [ ! -d "$CD/mysql/data/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$CD/mysql/data" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1 ||
      die "mariadb-install-db failed: see $LOG/mariadb-install.log"
  fi
  # its own datadir, socket and port, on 127.0.0.1 only; no /etc/mysql configuration
  setsid mariadbd --no-defaults --user=root --datadir="$CD/mysql/data" \
    --socket="$CD/mysql/mysqld.sock" --port="$P_MYSQL" --bind-address=127.0.0.1 \
    --pid-file="$PIDS/mariadb.pid" --log-error="$LOG/mariadb.log" --skip-name-resolve \
    --skip-log-bin --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
    </dev/null >>"$LOG/mariadb.log" 2>&1 &
  wait_for 60 mariadb mysql_cli -e "select 1"
  local pass
  pass=$(cat "$CD/mysql/slurm.pass")
  mysql_cli <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

start_slurmdbd() {
  SLURM_CONF=$CONF slurmdbd  # reads slurmdbd.conf beside SLURM_CONF; daemonizes
  wait_for 60 slurmdbd env SLURM_CONF="$CONF" sacctmgr -n list cluster
  if ! SLURM_CONF=$CONF sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
    SLURM_CONF=$CONF sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null
  fi
}

ctld_ok() { SLURM_CONF=$CONF scontrol ping | grep -q UP; }
start_slurmctld() {
  SLURM_CONF=$CONF slurmctld -f "$CONF"
  wait_for 60 slurmctld ctld_ok
}

node_state() { SLURM_CONF=$CONF sinfo -h -N -n "$(hostname -s)" -o %t 2>/dev/null; }
node_idle() { node_state | grep -qE '^(idle|mix|alloc)'; }
start_slurmd() {
  local stale
  # Jobs the controller still counts as running on a node whose slurmd is not running: left by a
  # stop that did not end them (a crash, a kill); they would hold the node's CPUs for good.
  stale=$(SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING -o %i | tr '\n' ' ')
  SLURM_CONF=$CONF slurmd -f "$CONF" -N "$(hostname -s)"
  if [ -n "${stale// /}" ]; then
    # shellcheck disable=SC2086
    SLURM_CONF=$CONF scancel $stale 2>/dev/null || true
    line slurmd "cancelled jobs ${stale% } (running when their slurmd was not)"
  fi
  wait_for 60 "slurmd (node $(hostname -s): $(node_state))" node_idle
}

ray_session() { cat "$PIDS/ray.sid" 2>/dev/null || true; }
# up once the autoscaler has reported the head node: on a slow or busy machine its monitor takes
# a minute or more to start after `ray start` returns
ray_ok() { timeout 60 "${RAY_LOCAL[@]}" "$VENV/bin/ray" status --address "127.0.0.1:$P_RAY"; }
ray_logs() {  # the last lines of the head's own logs, for a start that failed
  local f
  for f in "$LOG/ray-start.log" "$CD"/ray/session_latest/logs/{gcs_server,raylet,monitor}.{err,out}; do
    [ -s "$f" ] && { echo "--- $f"; tail -n 5 "$f"; }
  done
  "${RAY_LOCAL[@]}" timeout 60 "$VENV/bin/ray" status --address "127.0.0.1:$P_RAY" 2>&1 | tail -n 5
}
start_ray() {
  # its own session: `down` stops that session's processes, never another Ray on this machine
  # (`ray stop` would stop every Ray of this user)
  "${RAY_LOCAL[@]}" setsid "$VENV/bin/ray" start --head --node-ip-address=127.0.0.1 \
    --port="$P_RAY" --dashboard-port="$P_RAY_DASH" --dashboard-agent-listen-port="$P_RAY_AGENT" \
    --num-cpus=2 --include-dashboard=false \
    --disable-usage-stats --temp-dir="$CD/ray" </dev/null >"$LOG/ray-start.log" 2>&1 ||
    die "ray start failed: $(grep -iE 'error|exception' "$LOG/ray-start.log" | tail -1)"
  local gcs
  gcs=$(ps -eo pid=,args= | awk -v d="$CD/ray" 'index($0, "gcs_server") && index($0, d) {print $1; exit}')
  [ -n "$gcs" ] || die "ray start returned but no gcs_server of ours runs (see $LOG/ray-start.log)"
  echo "$gcs" >"$PIDS/ray.pid"
  ps -o sid= -p "$gcs" | tr -d ' ' >"$PIDS/ray.sid"
  until_ok 300 ray_ok || die "ray head did not answer \`ray status\` within 300 s:
$(ray_logs)"
}

write_env() {
  # shell syntax (KEY='value'), read by `set -a; . env` and by tests/cluster/conftest.py
  {
    echo "# Written by scripts/cluster.sh up: what a client of this cluster needs."
    printf "CLUSTER_DIR='%s'\n" "$CD"
    printf "SLURM_CONF='%s'\n" "$CONF"
    printf "CLUSTER_PARTITION='%s'\n" "$PARTITION"
    printf "RAY_ADDRESS='%s'\n" "127.0.0.1:$P_RAY"
    printf "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER='0'\n"
    printf "RAY_AUTH_MODE='disabled'\n"
  } >"$CD/env.tmp"
  mv "$CD/env.tmp" "$CD/env"
}

describe() {  # the status line of one service
  local name=$1 pid
  pid=$(pid_of "$name")
  if ! alive "$pid"; then
    line "$name" "stopped"
    return
  fi
  # shellcheck disable=SC1091
  [ -r "$CD/ports" ] && . "$CD/ports"
  case $name in
    munge) line munge "running  pid $pid  socket $CD/munge/munge.socket" ;;
    mariadb) line mariadb "running  pid $pid  127.0.0.1:$P_MYSQL" ;;
    slurmdbd) line slurmdbd "running  pid $pid  127.0.0.1:$P_DBD" ;;
    slurmctld) line slurmctld "running  pid $pid  127.0.0.1:$P_CTLD  cluster $CLUSTER_NAME" ;;
    slurmd) line slurmd "running  pid $pid  127.0.0.1:$P_SLURMD  node $(hostname -s) $(node_state), partition $PARTITION" ;;
    ray) line ray "running  pid $pid  head 127.0.0.1:$P_RAY" ;;
  esac
}

SERVICES=(munge mariadb slurmdbd slurmctld slurmd ray)

up() {
  local t0=$SECONDS name any=""
  [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd runs jobs as their users; the daemons run as root)"
  [ "$(uname -s)" = Linux ] || die "needs Linux"
  mkdir -p "$ETC" "$PIDS" "$LOG" "$CD/slurm/state" "$CD/slurm/spool" "$CD/mysql" "$CD/ray"
  install -d -m 755 "$CD/munge"
  install_debian
  install_ray
  for name in "${SERVICES[@]}"; do running "$name" && any=1; done
  if [ -z "$any" ]; then
    write_configs
  fi
  # shellcheck disable=SC1091
  . "$CD/ports"
  for name in "${SERVICES[@]}"; do
    if running "$name"; then
      describe "$name"
      continue
    fi
    "start_$name"
    describe "$name"
  done
  write_env
  echo "cluster up in $((SECONDS - t0)) s; clients: set -a; . $CD/env"
}

down() {
  local name pid sid
  [ "$(id -u)" -eq 0 ] || die "must run as root"
  [ -d "$CD" ] || { echo "nothing to stop: no $CD"; return 0; }
  # Ray first: its whole session (daemons and workers)
  pid=$(pid_of ray)
  sid=$(ray_session)
  if alive "$pid" && [ -n "$sid" ]; then
    # in `ray stop`'s order: the raylet, then the rest, the GCS last (stopped all at once, the
    # raylet and the GCS wait on each other until SIGKILL)
    # shellcheck disable=SC2046
    stop_pids 10 $(session_pids "$sid" raylet)
    # shellcheck disable=SC2046
    stop_pids 10 $(session_pids "$sid" | grep -vxF "$pid")
    # shellcheck disable=SC2046
    stop_pids 10 $(session_pids "$sid")
    line ray "stopped (pid $pid and its session $sid)"
  else
    line ray "not running"
  fi
  rm -f "$PIDS/ray.pid" "$PIDS/ray.sid"
  # jobs still on the node end before their slurmd does, so none outlives the cluster
  if running slurmctld && SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null | grep -q .; then
    SLURM_CONF=$CONF scancel --full --signal=KILL --state=RUNNING 2>/dev/null || true
    SLURM_CONF=$CONF scancel --state=PENDING 2>/dev/null || true
    for _ in $(seq 50); do
      SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING -o %i | grep -q . || break
      sleep 0.2
    done
  fi
  for name in slurmd slurmctld slurmdbd mariadb munge; do
    pid=$(pid_of "$name")
    if alive "$pid"; then
      stop_pids 20 "$pid"
      line "$name" "stopped (pid $pid)"
      # shellcheck disable=SC2046
      [ "$name" = slurmd ] && stop_pids 5 $(job_leftovers)
    else
      line "$name" "not running"
    fi
    rm -f "$PIDS/$name.pid"
  done
  rm -f "$CD/env"
}

status() {  # exits 0 when every service runs, 3 otherwise
  local name rc=0
  for name in "${SERVICES[@]}"; do
    describe "$name"
    running "$name" || rc=3
  done
  if [ -r "$CD/env" ]; then echo "env: $CD/env"; fi
  return $rc
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: bash scripts/cluster.sh up|down|status   (CLUSTER_DIR=$CD)" >&2; exit 2 ;;
esac
