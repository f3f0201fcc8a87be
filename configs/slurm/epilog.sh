#!/bin/bash
# silofs Slurm epilog: end what configs/slurm/prolog.sh set up for the job on this node
# (docs/CONTROLLER.md "Slurm"). Same settings file as the prolog ($SILOFS_SLURM_ENV,
# default /etc/silofs/slurm.env); uses $SILOFS only.
#
# `silofs end-job` finds the job's mounts in the kernel's mount table (every mount under
# $SILOFS_MOUNT_ROOT/$SLURM_JOB_ID, whoever made it) and through the daemon (the job's
# mounts elsewhere), unmounts them (lazily where a reader still holds files open), gives
# their mount processes a few seconds (then SIGTERM, then SIGKILL), forgets the job on
# the daemon (registration and IO allocation) and removes the job's directory, never
# waiting more than 2 s for the daemon. Each step is one log line.
#
# Exit status 0 when nothing of the job is left; 1 otherwise, after a line saying what
# (Slurm drains the node: a mount, a mount process or a job row that will not go away
# needs a person), and the job's directory is kept: run this again once the node is
# fixed (e.g. the daemon back) and it ends the rest.
#
# Then, for every job (a silofs one or not), `silofs end-dead-mounts` detaches the DEAD
# silofs mounts of the job's user: mounts the job's own script made (`silofs mount` in
# job.sh) whose mount process died with the job (scancel, a time limit, the OOM killer),
# which the kernel keeps, answering ENOTCONN to every access. Dead means the mount's
# process is gone: a probe as the user (statfs, in a child killed after 2 s) gets
# ENOTCONN. It never touches the user's live mounts (the user's other jobs on this node
# keep theirs), one whose probe does not answer (a stopped process), other users'
# mounts, nor root's (a root job's end leaves the node's own mounts alone). One line per
# mount it detaches or leaves; a failure is logged and never fails the epilog. A job
# whose user has no silofs mount on the node costs one read of the mount table.
set -u -o pipefail

ENV_FILE=${SILOFS_SLURM_ENV:-/etc/silofs/slurm.env}
# shellcheck disable=SC1090
[ -r "$ENV_FILE" ] && . "$ENV_FILE"
SILOFS=${SILOFS:-silofs}
ROOT=${SILOFS_MOUNT_ROOT:-/mnt/silofs}
export SILOFS_SOCKET=${SILOFS_SOCKET:-/run/silofs/control.sock}
JOB_ID=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run me as a Slurm epilog}
case "$JOB_ID" in *[!0-9]*) echo "silofs epilog: odd SLURM_JOB_ID $JOB_ID" >&2; exit 1 ;; esac
JOB="slurm-$JOB_ID"
DIR="$ROOT/$JOB_ID"

say() {
    local line
    line="$(date -u +%FT%TZ) epilog job $JOB_ID on $(hostname -s): $*"
    if [ -n "${SILOFS_SLURM_LOG:-}" ]; then
        echo "$line" >>"$SILOFS_SLURM_LOG"
    else
        logger -t silofs-slurm "$line" 2>/dev/null || echo "$line" >&2
    fi
}

# Whether uid $1 has a silofs FUSE mount in this mount table (as silofs/mountinfo.py
# tells one): most jobs' users have none, and then no python starts.
has_silofs_mount() {
    awk -v uid="$1" '{
        for (i = 7; i < NF && $i != "-"; i++) {}
        type = $(i + 1); source = $(i + 2); opts = "," $(i + 3) ","
        if (type ~ /^fuse/ && (type == "fuse.silofs" || source ~ /^silofs:/) &&
            index(opts, ",user_id=" uid ",")) { found = 1; exit }
    } END { exit !found }' /proc/self/mountinfo
}

end_dead_mounts() {
    local uid=${SLURM_JOB_UID:-} status
    case "$uid" in
        "" | 0) return 0 ;;  # no user named; root's are the node's own mounts
        *[!0-9]*) say "odd SLURM_JOB_UID $uid: its dead mounts are left"; return 0 ;;
    esac
    has_silofs_mount "$uid" || return 0
    # It bounds itself (2 s for all probes, 2 s per detach); the outer timeout is for a
    # process it cannot get past.
    timeout -k 5 30 "$SILOFS" end-dead-mounts --uid "$uid" 2>&1 |
        while IFS= read -r line; do say "$line"; done
    status=${PIPESTATUS[0]}
    # A dead mount left is the user's to remove (`silofs unmount`): logged, and the
    # node stays in service.
    [ "$status" = 0 ] || say "silofs end-dead-mounts exited $status (the node stays in service)"
}

status=0
if [ -d "$DIR" ]; then  # else not a silofs job (the prolog removes what it fails to mount)
    # end-job bounds itself; the outer timeout is for a process it cannot get past.
    timeout -k 5 60 "$SILOFS" end-job --dir "$DIR" -- "$JOB" 2>&1 |
        while IFS= read -r line; do say "$line"; done
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || say "FAILED: silofs end-job exited $status"
fi
end_dead_mounts
[ "$status" = 0 ]
