"""`silofs-ctl simulate --json`'s text: json.dumps(indent=2) against json_indent.dumps.

Owns: loading a result a run printed with --json, and timing the two ways of writing it
again, alternating (process CPU, min and median of --repeats each), with whether the
two texts are the same and the file's own text. Never: runs a simulation (pass the
output of one: `silofs-ctl simulate TRACE --scheduler gavel --cache alluxio --json >
R.json`).

    python bench/json_out.py R.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401 - this checkout first on sys.path
from silofs_ctl import json_indent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a --json output of silofs-ctl simulate")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    text = args.result.read_text()
    obj = json.loads(text)
    cpu: dict[str, list[float]] = {"json.dumps(indent=2)": [], "json_indent.dumps": []}
    outs: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, dump in (
            ("json.dumps(indent=2)", lambda o: json.dumps(o, indent=2)),
            ("json_indent.dumps", json_indent.dumps),
        ):
            start = time.process_time()
            outs[name] = dump(obj)
            cpu[name].append(time.process_time() - start)
    size = len(text) / 1e6
    print(f"{args.result.name}: {size:.1f} MB, {len(obj.get('timeline', ()))} timeline records")
    for name, times in cpu.items():
        print(f"  {name:22} min {min(times):.2f} s, median {statistics.median(times):.2f} s")
    fast, slow = outs["json_indent.dumps"], outs["json.dumps(indent=2)"]
    print(f"  the same text: {fast == slow}; the file's: {fast + chr(10) == text}")


if __name__ == "__main__":
    main()
