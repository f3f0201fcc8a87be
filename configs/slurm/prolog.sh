#!/bin/bash
# silofs Slurm prolog: register the job (GPUs, f*, epochs, datasets, its user) with the
# node daemon, so `silofs-ctl controller` plans with them (docs/CONTROLLER.md "Slurm"),
# then mount the job's datasets on this node.
#
# slurm.conf on every node:
#   Prolog=/etc/silofs/slurm/prolog.sh
#   Epilog=/etc/silofs/slurm/epilog.sh
#   PrologFlags=Alloc        # run at allocation, before the batch script or first step
#
# A job names its datasets in its comment, whitespace-separated tokens (others ignored):
#   sbatch --gpus=8 --comment "silofs=s3://bucket/imagenet/ silofs.ideal_io=900MB/s silofs.epochs=90" train.sh
#   silofs=URI            a dataset (repeat for more); mounted read-only at
#                         $SILOFS_MOUNT_ROOT/$SLURM_JOB_ID/NAME, NAME = the URI's last part
#   silofs.ideal_io=RATE  f*: the job's read rate when IO is no bottleneck (optional;
#                         else the controller measures it)
#   silofs.epochs=N       epochs in total (optional; SJF uses the remaining work)
# The job runs as silofs job "slurm-$SLURM_JOB_ID". The registration comes FIRST and
# names the job's user (--uid $SLURM_JOB_UID): a name slurm-N is usable by an ordinary
# user only once it is registered for that user's uid, and a registered uid owns the
# job (docs/SECURITY.md "Jobs"). Mounting first let any user take the next job ids'
# names with `silofs mount --job slurm-N`, and the real owner's prolog mount was then
# refused and the job cancelled.
#
# Who mounts (SILOFS_MOUNT_AS): the comment is the job owner's text and this script runs
# as root, so by default ("user") each dataset is mounted BY THE JOB'S USER (runuser):
# the daemon then checks the dataset, every directory of it and every object read as
# that user (docs/SECURITY.md), exactly as for a mount the user made by hand. Mount
# processes read the cache directly, so the job's users must be members of the daemon's
# socket_group (who may then read every cached byte: docs/SECURITY.md "socket_group").
# "root" mounts as root with --allow-other and files owned by the job's user: any job
# may then read any dataset the daemon can, root-only files included. Use it only on a
# cluster where every dataset is meant for every user.
#
# Settings come from $SILOFS_SLURM_ENV (default /etc/silofs/slurm.env), a shell file:
#   SILOFS=/opt/silofs/bin/silofs  SILOFS_CTL=/opt/silofs/bin/silofs-ctl
#   SILOFS_SOCKET=/run/silofs/control.sock  SILOFS_MOUNT_ROOT=/mnt/silofs
#   SILOFS_SLURM_LOG=/var/log/silofs/slurm.log (else syslog via logger)
#   SILOFS_MOUNT_AS=user (default) or root: see "Who mounts" above
#
# Exit status: 0 with no silofs token in the comment (nothing to do) or registered and
# all mounted. A registration refused or a dataset that will not mount while the node
# daemon answers is the job's own problem (silofs.epochs=-1, a path its user may not
# read, a typo, a bucket that does not exist, a store that refuses): the prolog unmounts
# what it mounted, forgets the registration, cancels the job with the reason (scancel,
# the reason in the job's AdminComment and the log) and exits 0, so one user's comment
# can never drain a node. Anything else (the daemon does not answer, the mount root
# cannot be made, the job's user cannot run $SILOFS) is the node's: 1 after the same
# undoing, and Slurm requeues the job held and drains the node, for a person to look.
set -u -o pipefail

ENV_FILE=${SILOFS_SLURM_ENV:-/etc/silofs/slurm.env}
# shellcheck disable=SC1090
[ -r "$ENV_FILE" ] && . "$ENV_FILE"
SILOFS=${SILOFS:-silofs}
SILOFS_CTL=${SILOFS_CTL:-silofs-ctl}
ROOT=${SILOFS_MOUNT_ROOT:-/mnt/silofs}
export SILOFS_SOCKET=${SILOFS_SOCKET:-/run/silofs/control.sock}
JOB_ID=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run me as a Slurm prolog}
case "$JOB_ID" in *[!0-9]*) echo "silofs prolog: odd SLURM_JOB_ID $JOB_ID" >&2; exit 1 ;; esac
JOB="slurm-$JOB_ID"

say() {
    local line
    line="$(date -u +%FT%TZ) prolog job $JOB_ID on $(hostname -s): $*"
    if [ -n "${SILOFS_SLURM_LOG:-}" ]; then
        echo "$line" >>"$SILOFS_SLURM_LOG"
    else
        logger -t silofs-slurm "$line" 2>/dev/null || echo "$line" >&2
    fi
}

# The comment: SLURM_JOB_COMMENT where Slurm gives it, else ask slurmctld.
COMMENT=${SLURM_JOB_COMMENT:-$(squeue -h -j "$JOB_ID" -o %k 2>/dev/null || true)}
[ "$COMMENT" = "(null)" ] && COMMENT=""
DATASETS=()
IDEAL_IO=""
EPOCHS=""
for token in $COMMENT; do
    case "$token" in
        silofs=?*) DATASETS+=("${token#silofs=}") ;;
        silofs.ideal_io=?*) IDEAL_IO=${token#silofs.ideal_io=} ;;
        silofs.epochs=?*) EPOCHS=${token#silofs.epochs=} ;;
    esac
done
if [ ${#DATASETS[@]} -eq 0 ]; then
    exit 0  # not a silofs job
fi

# GPUs of the whole job: gres/gpu=N in its TRES, else the GPUs Slurm gave it here.
JOB_INFO=$(scontrol show job -o "$JOB_ID" 2>/dev/null || true)
GPUS=$(grep -o 'gres/gpu=[0-9]*' <<<"$JOB_INFO" | head -n1 | cut -d= -f2)
if [ -z "$GPUS" ] && [ -n "${SLURM_JOB_GPUS:-}" ]; then
    GPUS=$(tr ',' '\n' <<<"$SLURM_JOB_GPUS" | grep -c .)
fi
GPUS=${GPUS:-0}
NODES=()
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null)
fi

MOUNTED=()
REGISTERED=0
# Unmount what this prolog mounted, remove the job's directory, and forget the job's
# registration (a cancelled job leaves none; errors ignored: the epilog's end-job
# forgets it too).
undo() {
    for mp in "${MOUNTED[@]}"; do
        "$SILOFS" unmount "$mp" >/dev/null 2>&1 || fusermount3 -u -z "$mp" 2>/dev/null
        rmdir "$mp" 2>/dev/null
    done
    MOUNTED=()
    rmdir "$ROOT/$JOB_ID" 2>/dev/null
    if [ "$REGISTERED" = 1 ]; then
        "$SILOFS_CTL" forget --kind job "$JOB" >/dev/null 2>&1
        REGISTERED=0
    fi
}

fail() {
    say "FAILED: $*"
    undo
    echo "silofs prolog: $*" >&2
    exit 1
}

# The job's own dataset failed while this node works: cancel the job, keep the node.
refuse() {
    if ! "$SILOFS_CTL" status >/dev/null 2>&1; then
        fail "$*"  # the daemon does not answer: not the job's fault
    fi
    undo
    local reason
    reason="silofs: $(printf '%s' "$*" | tr -c '[:print:]' ' ' | cut -c1-400)"
    scontrol update "JobId=$JOB_ID" "AdminComment=$reason" >/dev/null 2>&1 || true
    if ! scancel "$JOB_ID" >/dev/null 2>&1; then
        fail "$* (and scancel failed)"
    fi
    say "FAILED: $* (the node daemon answers: the job is cancelled, the node stays up)"
    echo "silofs prolog: $*" >&2
    exit 0
}

# Mount as the job's user unless told otherwise, or unless the job is root's.
AS_USER=0
JOB_USER=""
if [ "${SILOFS_MOUNT_AS:-user}" = user ] && [ "${SLURM_JOB_UID:-0}" != 0 ]; then
    AS_USER=1
    JOB_USER=${SLURM_JOB_USER:-$(id -nu "$SLURM_JOB_UID" 2>/dev/null)}
    [ -n "$JOB_USER" ] || fail "no user name for uid $SLURM_JOB_UID"
elif [ "${SILOFS_MOUNT_AS:-user}" != user ] && [ "${SILOFS_MOUNT_AS}" != root ]; then
    fail "SILOFS_MOUNT_AS must be user or root, not ${SILOFS_MOUNT_AS}"
fi

# Register before mounting: the job's user owns slurm-N from here on (also in "root"
# mode: its own job script may then mount under the job's name), and no one else may
# mount under it. Refused while the daemon answers: the comment's silofs.ideal_io or
# silofs.epochs (the job owner's text: `fast`, `-1`, a rate without a unit) is the
# job's fault, and cancels it (nothing is mounted yet); it must not drain the node.
reg=(job register "$JOB" --gpus "$GPUS" --scheduler slurm --scheduler-id "$JOB_ID")
for uri in "${DATASETS[@]}"; do reg+=(--dataset "$uri"); done
for node in "${NODES[@]}"; do reg+=(--node "$node"); done
[ -n "$IDEAL_IO" ] && reg+=(--ideal-io "$IDEAL_IO")
[ -n "$EPOCHS" ] && reg+=(--epochs "$EPOCHS")
[ -n "${SLURM_JOB_UID:-}" ] && reg+=(--uid "$SLURM_JOB_UID")
if ! out=$("$SILOFS_CTL" "${reg[@]}" 2>&1); then
    refuse "register: $out"
fi
REGISTERED=1
say "registered $JOB: uid=${SLURM_JOB_UID:-none} gpus=$GPUS ideal_io=${IDEAL_IO:-measured} epochs=${EPOCHS:-unknown} datasets=${DATASETS[*]}"

mkdir -p "$ROOT/$JOB_ID" || fail "cannot create $ROOT/$JOB_ID"
chmod 0755 "$ROOT/$JOB_ID"
declare -A USED=()
for uri in "${DATASETS[@]}"; do
    # The directory name comes from the job owner's text: letters, digits, '.', '_'
    # and '-' only, never "." or ".." (a "silofs=/x/.." must not make root chown the
    # mount root to the user).
    name=${uri%/}
    name=${name##*/}
    name=$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-64)
    case "$name" in "" | . | ..) name=data ;; esac
    base=$name
    n=1
    while [ -n "${USED[$name]:-}" ]; do
        n=$((n + 1))
        name="$base-$n"
    done
    USED[$name]=1
    mp="$ROOT/$JOB_ID/$name"
    mkdir -p "$mp" || fail "cannot create $mp"
    # Options first, then "--": a URI that begins with "-" is a URI, not an option.
    # --no-start-daemon: a node daemon that is down is the node's failure (below), never
    # a reason to start an ad-hoc daemon without the node's config on its socket.
    args=(mount --no-start-daemon --job "$JOB")
    if [ "$AS_USER" = 1 ]; then
        chown "$SLURM_JOB_UID:${SLURM_JOB_GID:-$SLURM_JOB_UID}" "$mp"
        cmd=(runuser -u "$JOB_USER" -- env "SILOFS_SOCKET=$SILOFS_SOCKET" "$SILOFS"
            "${args[@]}" -- "$uri" "$mp")
    else
        args+=(--allow-other)
        [ -n "${SLURM_JOB_UID:-}" ] && args+=(--uid "$SLURM_JOB_UID")
        [ -n "${SLURM_JOB_GID:-}" ] && args+=(--gid "$SLURM_JOB_GID")
        cmd=("$SILOFS" "${args[@]}" -- "$uri" "$mp")
    fi
    if ! out=$(cd / && "${cmd[@]}" 2>&1); then
        rmdir "$mp" 2>/dev/null
        # A silofs the job's user cannot run at all (a venv of a python under /root,
        # a venv not readable by all) fails every job: the node's, not this job's.
        # Asked only after a failure, so a job that mounts pays nothing for it.
        if [ "$AS_USER" = 1 ] &&
            ! (cd / && runuser -u "$JOB_USER" -- "$SILOFS" --version >/dev/null 2>&1); then
            fail "the job's user $JOB_USER cannot run $SILOFS ($out): install silofs readable by every user, from a python outside /root (README \"Under Slurm\", step 1)"
        fi
        refuse "mount $uri at $mp: $out"
    fi
    MOUNTED+=("$mp")
    say "mounted $uri at $mp"
done

exit 0
