#!/usr/bin/env bash
# `make slurm`: a one-node SLURM cluster on this machine (Debian or Ubuntu, as root), for the
# tests marked `slurm` (docs/distributed.md). Installs slurmctld, slurmd and munge with
# apt-get when they are missing, writes /etc/slurm/slurm.conf from slurm.conf.in beside this
# script, creates the munge key, starts munged, slurmctld and slurmd, and waits until the
# node is idle. Run again, it does nothing when the cluster is up with this configuration.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
conf=/etc/slurm/slurm.conf
host="$(hostname -s)"
cpus="$(nproc)"
(( cpus >= 2 )) || cpus=2  # the 2-task test job needs two; config_overrides lets slurmd accept them
wait_s="${SLURM_UP_WAIT_S:-120}"

fail() { echo "make slurm: $*" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || fail "needs root (it installs Debian packages and starts daemons)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sinfo >/dev/null \
        || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

wanted="$(sed -e "s/@HOST@/$host/g" -e "s/@CPUS@/$cpus/g" "$here/slurm.conf.in")"

node_state() { sinfo -h -n "$host" -o %T 2>/dev/null | head -n1 || true; }  # empty while slurmctld starts
running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [[ -f "$conf" && "$(cat "$conf")" == "$wanted" ]] && scontrol ping 2>/dev/null | grep -q UP \
        && [[ "$(node_state)" =~ ^(idle|mixed|allocated)$ ]]; then
    echo "the SLURM cluster is up: node $host $(node_state)"
    exit 0
fi

# munge: the key (the package's post-install script makes one; a bare image may lack it)
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
fi

# a configuration that changed: stop the daemons that run with the old one
if [[ -f "$conf" && "$(cat "$conf")" != "$wanted" ]]; then
    for pidfile in /run/slurmctld.pid /run/slurmd.pid; do
        if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
    done
    for _ in $(seq 50); do
        running /run/slurmctld.pid || running /run/slurmd.pid || break
        sleep 0.2
    done
fi
mkdir -p /etc/slurm
printf '%s\n' "$wanted" > "$conf"
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/log/slurm
install -d /var/lib/slurm/slurmd

running /run/slurmctld.pid || slurmctld
running /run/slurmd.pid || slurmd

for _ in $(seq "$wait_s"); do
    state="$(node_state)"
    case "$state" in
        idle|mixed|allocated) echo "the SLURM cluster is up: node $host $state"; exit 0 ;;
        down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "make slurm: node $host is '${state:-unknown}' after ${wait_s} s; the last lines of the logs:" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
