"""`python -m app.report RUN_DIR`: write RUN_DIR/report.html, one self-contained page of the run's plots.

RUN_DIR is the run's `checkpoint.dir`; the page is built from `timeline.jsonl` and `summary.json` there
(see `app/run/outputs/report_page.py`). The driver writes the same page at the end of every run.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from app.run.outputs.report_page import fetch_run_files, publish_report, write_report
    from app.storage.roots import redact
    from app.run.outputs.timeline import FILE_NAME, iter_timeline

    p = argparse.ArgumentParser(prog="python -m app.report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's checkpoint.dir")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    # A URI run (s3://, file://): its timeline and summary are read in the local cache, the page uploaded back.
    location, args.run_dir = args.run_dir, str(fetch_run_files(args.run_dir))
    if next(iter_timeline(args.run_dir), None) is None:  # one row read, not the whole file
        print(f"error: no {FILE_NAME} in {args.run_dir}; give the checkpoint.dir of a run started by this "
              "version of python -m app.train", file=sys.stderr)
        return 2
    out = write_report(args.run_dir)
    print(f"wrote {redact(publish_report(location, out))} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
