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
# fixed (e.g. the daemon back) and it ends the rest. A job the prolog made no directory
# for exits 0 at once.
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

[ -d "$DIR" ] || exit 0  # not a silofs job (the prolog removes what it fails to mount)
# end-job bounds itself; the outer timeout is for a process it cannot get past.
timeout -k 5 60 "$SILOFS" end-job --dir "$DIR" -- "$JOB" 2>&1 |
    while IFS= read -r line; do say "$line"; done
status=${PIPESTATUS[0]}
[ "$status" = 0 ] && exit 0
say "FAILED: silofs end-job exited $status"
exit 1
