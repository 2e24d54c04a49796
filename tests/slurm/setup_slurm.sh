#!/usr/bin/env bash
# Test set-up: a one-node Slurm (munge + slurmctld + slurmd) on this machine, for
# tests/slurm. Installs Debian's slurm-wlm and munge when missing, writes a minimal
# slurm.conf for this host and starts the daemons. Root only; idempotent; exits 0 with a
# message (never fails CI) when it cannot: the slurm tests then skip, saying why.
#
#   sudo tests/slurm/setup_slurm.sh          # install + start
#   sudo tests/slurm/setup_slurm.sh --no-install   # start only what is installed
#   sudo tests/slurm/setup_slurm.sh stop     # stop the daemons
set -u
say() { echo "setup_slurm: $*"; }
if [ "$(id -u)" != 0 ]; then say "not root: skipping (slurm tests will skip)"; exit 0; fi
NO_INSTALL=0; [ "${1:-}" = --no-install ] && NO_INSTALL=1
if [ "${1:-}" = stop ]; then
    for d in slurmd slurmctld munged; do
        [ -f "/run/hvdnb-slurm/$d.pid" ] && kill "$(cat /run/hvdnb-slurm/$d.pid)" 2>/dev/null
    done
    say "stopped"; exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    [ "$NO_INSTALL" = 1 ] && { say "slurm-wlm or munge is not installed (run this script without --no-install): slurm tests will skip"; exit 0; }
    say "installing slurm-wlm and munge (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
        >/tmp/hvdnb-slurm-apt.log 2>&1 || { say "apt failed (see /tmp/hvdnb-slurm-apt.log): slurm tests will skip"; exit 0; }
fi
if scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    say "already running"; exit 0
fi
if [ -e /etc/slurm/slurm.conf ] && ! grep -q "written by hvdnb" /etc/slurm/slurm.conf; then
    say "/etc/slurm/slurm.conf exists and is not ours: leaving this machine's Slurm alone (slurm tests will skip unless it runs)"
    exit 0
fi
mkdir -p /run/hvdnb-slurm /run/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /etc/slurm
# munge: a key and the daemon
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
id munge >/dev/null 2>&1 && chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
    if id munge >/dev/null 2>&1; then
        su -s /bin/sh munge -c "munged --pid-file=/run/munge/munged.pid" || munged --force
    else
        munged --force
    fi
    cp /run/munge/munged.pid /run/hvdnb-slurm/munged.pid 2>/dev/null
fi
host=$(hostname -s)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
cat > /etc/slurm/slurm.conf <<CONF
# written by hvdnb tests/slurm/setup_slurm.sh: one node, for tests only
ClusterName=hvdnb-test
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/hvdnb-slurm/slurmctld.pid
SlurmdPidFile=/run/hvdnb-slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdTimeout=30
KillWait=2
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
printf 'ConstrainCores=no\n' > /etc/slurm/cgroup.conf
pgrep -x slurmctld >/dev/null || slurmctld -i || { say "slurmctld did not start (see /var/log/slurm/slurmctld.log): slurm tests will skip"; exit 0; }
pgrep -x slurmd >/dev/null || slurmd || { say "slurmd did not start (see /var/log/slurm/slurmd.log): slurm tests will skip"; exit 0; }
for _ in $(seq 1 30); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        say "slurm is up: $(sinfo -h -o '%P %D %T %C')"; exit 0
    fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1
    sleep 1
done
say "slurm did not become ready ($(sinfo -h 2>&1 | head -1)): slurm tests will skip"
exit 0
