"""`python -m silofs_ctl`: the same as the `silofs-ctl` command. Owns nothing else."""

from silofs_ctl.cli import main

main(prog_name="silofs-ctl")
