#!/bin/bash
# silofs Slurm epilog: unmount what configs/slurm/prolog.sh mounted for the job on this
# node and forget the job's registration and IO allocation (docs/CONTROLLER.md "Slurm").
# Same settings file as the prolog ($SILOFS_SLURM_ENV, default /etc/silofs/slurm.env).
#
# Exit status 0 when nothing of the job is left mounted; 1 otherwise (Slurm drains the
# node: a mount that will not go away needs a person). A job without silofs mounts
# exits 0 at once.
set -u -o pipefail

ENV_FILE=${SILOFS_SLURM_ENV:-/etc/silofs/slurm.env}
# shellcheck disable=SC1090
[ -r "$ENV_FILE" ] && . "$ENV_FILE"
SILOFS=${SILOFS:-silofs}
SILOFS_CTL=${SILOFS_CTL:-silofs-ctl}
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

[ -d "$DIR" ] || exit 0
status=0
for mp in "$DIR"/*; do
    [ -d "$mp" ] || continue
    if mountpoint -q "$mp"; then
        # `silofs unmount` waits for the mount process (it deregisters on its way out);
        # a reader still holding files open is detached lazily rather than kept.
        if ! out=$("$SILOFS" unmount -- "$mp" 2>&1); then
            fusermount3 -u -z "$mp" 2>/dev/null
            say "unmount $mp: $out (detached lazily)"
        fi
    fi
    if mountpoint -q "$mp"; then
        say "FAILED: $mp is still mounted"
        status=1
        continue
    fi
    rmdir "$mp" 2>/dev/null
    say "unmounted $mp"
done
rmdir "$DIR" 2>/dev/null

# Forget the job (registration and IO allocation). A lazily detached mount process
# deregisters when it exits: give it a few seconds, then leave the row (harmless).
for _ in $(seq 1 50); do
    if out=$("$SILOFS_CTL" forget --kind job "$JOB" 2>&1); then
        say "forgot $JOB"
        break
    fi
    case "$out" in
        *"no dataset or job"*) break ;;
    esac
    sleep 0.2
done
exit $status
