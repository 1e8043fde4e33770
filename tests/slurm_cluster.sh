#!/usr/bin/env bash
# A one-node SLURM cluster for tests/workflow/test_slurm.py (or by hand): munged + slurmctld + slurmd started by hand (no
# systemd, no slurmdbd, no cgroups), everything under one private folder with its own ports (16817/16818) and munge
# key and socket, so a machine's own munge and SLURM daemons are left alone.
#
#   bash tests/slurm_cluster.sh start DIR    # installs the Debian packages if missing (root), starts, waits for idle
#   bash tests/slurm_cluster.sh stop DIR     # cancels the jobs, stops the three daemons (by their pid files in DIR)
#   export SLURM_CONF=DIR/slurm.conf          # then sinfo, sbatch, squeue, snakemake --profile workflow/profiles/slurm
#
# Clients find the config through SLURM_CONF, but Snakemake's jobstep drops SLURM_* from a job's environment before
# its srun, which then reads the compiled-in /etc/slurm/slurm.conf: start links that to DIR's (only where the
# machine has no slurm.conf of its own: otherwise exit 3); stop removes the link.
#
# The node is this host: its CPUs and 80 % of its memory (LOWMEMBP_SLURM_CPUS / LOWMEMBP_SLURM_MEM_MB change
# them; SlurmdParameters=config_overrides lets it advertise more than it has), LOWMEMBP_SLURM_GPUS (1) fake GPUs
# (gres "gpu" on character devices made in DIR; a job that asks for --gpus=1 is granted one and sees
# CUDA_VISIBLE_DEVICES), partitions "debug" (default) and "gpu". No accounting: sacct does not work, so Snakemake's
# plugin needs --slurm-status-command squeue (the profile sets it) and MinJobAge at least three times its
# first-status-check delay (3600 s here: a test still sees every finished job at the end).
# Needs root. Exit codes: 0 up / stopped, 1 failed (logs shown), 2 usage, 3 cannot run here (the reason on stderr).
set -euo pipefail
ACTION=${1:-}; DIR=${2:-}
die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }
cannot() { echo "slurm_cluster.sh: cannot run here: $*" >&2; exit 3; }
[ "$ACTION" = start ] || [ "$ACTION" = stop ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ -n "$DIR" ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ "$ACTION" = stop ] || [ "$(id -u)" = 0 ] || cannot "needs root (it starts slurmd and munged)"
mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
CONF=$DIR/slurm.conf SOCK=$DIR/munge/munge.socket.2
export SLURM_CONF=$CONF
PIDS=("$DIR/slurmd.pid:slurmd" "$DIR/slurmctld.pid:slurmctld" "$DIR/munge/munged.pid:munged")

alive() {  # pid file, command name: the daemon we started is running
  local p; [ -s "$1" ] && p=$(cat "$1") && kill -0 "$p" 2>/dev/null && grep -qx "$2" "/proc/$p/comm"
}
stop_one() {
  local p; alive "$1" "$2" || return 0; p=$(cat "$1"); kill "$p" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$p" 2>/dev/null || true
}
SYSCONF=/etc/slurm/slurm.conf
ours() { [ -L "$SYSCONF" ] && [ "$(readlink "$SYSCONF")" = "$CONF" ]; }
stop_all() {
  if [ -f "$CONF" ] && alive "$DIR/slurmctld.pid" slurmctld; then
    timeout 10 scancel --quiet --full --partition=debug,gpu 2>/dev/null || true  # this cluster's jobs only
  fi
  for e in "${PIDS[@]}"; do stop_one "${e%%:*}" "${e##*:}"; done
  if ours; then rm -f "$SYSCONF"; fi
}
if [ "$ACTION" = stop ]; then stop_all; echo "local SLURM in $DIR stopped"; exit 0; fi

NEED="slurmctld slurmd sbatch squeue scontrol sinfo munged munge unmunge"
export PATH=$PATH:/usr/sbin
missing() { for c in $NEED; do command -v "$c" >/dev/null || return 0; done; return 1; }
if missing; then
  command -v apt-get >/dev/null || cannot "slurm is not installed and there is no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q slurmctld slurmd slurm-client munge || { apt-get update -q && apt-get install -y -q slurmctld slurmd slurm-client munge; }; } >"$DIR/apt.log" 2>&1 \
    || cannot "apt-get install slurmctld slurmd slurm-client munge failed (see $DIR/apt.log)"
fi

if [ -e "$SYSCONF" ] || [ -L "$SYSCONF" ]; then
  ours || { [ -L "$SYSCONF" ] && [ ! -e "$SYSCONF" ]; } || grep -qs "^ClusterName=lowmembp-test$" "$SYSCONF" \
    || cannot "this machine has its own $SYSCONF (a real SLURM setup: left alone)"
fi
NODE=$(hostname -s)
CPUS=${LOWMEMBP_SLURM_CPUS:-$(nproc --all)}  # --all: plain nproc follows OMP_NUM_THREADS
MEM=${LOWMEMBP_SLURM_MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)}
GPUS=${LOWMEMBP_SLURM_GPUS:-1}
CTLD_PORT=${LOWMEMBP_SLURMCTLD_PORT:-16817} SLURMD_PORT=${LOWMEMBP_SLURMD_PORT:-16818}
stop_all  # a previous start in DIR (a changed config needs a restart anyway; startup takes a second)
for port in "$CTLD_PORT" "$SLURMD_PORT"; do
  if (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then cannot "port $port is in use (another test cluster?)"; fi
done
mkdir -p "$DIR"/{state,spool,log,dev,munge}
rm -f "$DIR"/state/* 2>/dev/null || true  # no jobs or node states from an earlier cluster in DIR

: >"$DIR/gres.conf"; GRES=""
if [ "$GPUS" -gt 0 ]; then
  for i in $(seq 0 $((GPUS - 1))); do
    d=$DIR/dev/nvidia$i; [ -c "$d" ] || mknod "$d" c 1 3 || die "mknod $d failed"  # 1,3 = /dev/null's numbers
    echo "NodeName=$NODE Name=gpu File=$d" >>"$DIR/gres.conf"
  done
  GRES=" Gres=gpu:$GPUS"
fi
cat >"$CONF" <<EOF
ClusterName=lowmembp-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
MinJobAge=3600
InactiveLimit=0
KillWait=5
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM$GRES State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
EOF

mkdir -p /etc/slurm; ln -sfn "$CONF" "$SYSCONF"

# munge: its own key, socket, pid, log and seed in DIR, run as root like the other two (DIR may be private to root,
# as pytest's tmp folders are); munged refuses a key others can read: 0400
[ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$DIR/munge"; chmod 400 "$DIR/munge/munge.key"
munged --force --socket="$SOCK" --key-file="$DIR/munge/munge.key" \
  --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
  || die "munged did not start: $(tail -3 "$DIR/munge/munged.log" 2>/dev/null)"
ok=0; for _ in $(seq 50); do munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null 2>&1 && { ok=1; break; }; sleep 0.2; done
[ $ok = 1 ] || die "munge does not answer on $SOCK: $(tail -3 "$DIR/munge/munged.log" 2>/dev/null)"

show_logs() { tail -n 5 "$DIR"/log/*.log >&2 2>/dev/null || true; }
slurmctld -f "$CONF" || { show_logs; die "slurmctld did not start"; }
ok=0; for _ in $(seq 50); do scontrol ping 2>/dev/null | grep -q UP && { ok=1; break; }; sleep 0.2; done
[ $ok = 1 ] || { show_logs; die "slurmctld does not answer"; }
slurmd -f "$CONF" || { show_logs; die "slurmd did not start"; }
state=""
for _ in $(seq 60); do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1 || true)
  case "$state" in
    idle) break ;;
    drain* | down* | inval*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.5
done
[ "$state" = idle ] || { show_logs; die "node $NODE is '$state', not idle"; }
echo "local SLURM up in $DIR: node $NODE idle, $CPUS CPUs, $MEM MB, $GPUS GPU(s); export SLURM_CONF=$CONF"
