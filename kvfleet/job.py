"""The `ray job submit` entrypoint: prompts from a JSONL file -> completions to a JSONL file.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m kvfleet.job --config tiny --input prompts.jsonl --output results.jsonl

Inside a Ray job ``RAY_ADDRESS`` is set, so the job attaches to the job's cluster
(``ray.address=auto``) unless the config names an address; without it, it starts an embedded
Ray. Exit code 0 when every line ran; 3 when some lines failed (each is reported as
``file:line: <field-named error>`` and has an error record in the output, see ``cluster.jsonl``;
the other lines ran); 2 on a bad config, arguments or an unreadable or empty input file; 1 on
any other failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from configs import ConfigError, load_config
from configs.logs import setup_logging
from kvfleet.cli import (
    EXIT_BAD_CONFIG,
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_PARTIAL,
    report_config_error,
    report_line_errors,
    run_items,
)

log = logging.getLogger("kvfleet.job")
PROG = "kvfleet.job"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.job", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="local", help="preset name or path to a YAML file (default: local)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--input", required=True, help='JSONL file of {"prompt": ...} lines')
    parser.add_argument("--output", required=True, help="JSONL file to write the results to")
    parser.add_argument("--max-tokens", type=int, default=32, help="default tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if os.environ.get("RAY_ADDRESS") and not any(o.split("=", 1)[0].strip() == "ray.address" for o in overrides):
        overrides.append("ray.address=auto")
    try:
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as exc:
        report_config_error(PROG, exc)
        return EXIT_BAD_CONFIG
    setup_logging(config.logging)
    from cluster.jsonl import read_prompts
    from engine.sampling_params import SamplingParams

    try:
        defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        entries = report_line_errors(PROG, read_prompts(args.input, defaults))
    except (ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not entries:
        print(f"{PROG}: {args.input} holds no prompts", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.info("running %d lines with config %s (ray.address=%s)", len(entries), args.config, config.ray.address)
    code = run_items(config, entries, args.output, progress=False, prog=PROG)
    if code in (0, EXIT_PARTIAL):
        log.info("wrote %d records to %s", len(entries), args.output)
    return code if code in (0, EXIT_BAD_INPUT, EXIT_PARTIAL) else EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
