"""The `kvfleet` command line: `config`, `generate` and `serve`, each with `--config` and
`--set a.b=c`. The cluster benchmark is not a command: run `python -m benchmarks.cluster_bench`
from the repository (``benchmarks/README.md``).

Exit codes (the same for `python -m kvfleet.job`):

- 0: every prompt ran and has its result in the output;
- 1 (``EXIT_FAILURE``): the cluster itself failed;
- 2 (``EXIT_BAD_CONFIG``, ``EXIT_BAD_INPUT``): a bad invocation, nothing ran: a bad config or
  override, a bad prompt or sampling value on the command line, an input file that cannot be
  read or holds no prompts;
- 3 (``EXIT_PARTIAL``): some JSONL lines failed (malformed, a bad field, a prompt too long for
  the model); each is reported as ``file:line: <field-named error>`` and has an error record in
  the output in its place (see ``cluster.jsonl``), and every other line ran.

Every message names the field and the value (``temperature: must be a finite number (got nan)``),
without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from configs import ClusterConfig, ConfigError, available_presets, config_to_yaml, load_config
from configs.logs import setup_logging

EXIT_FAILURE = 1
EXIT_BAD_CONFIG = 2
EXIT_BAD_INPUT = 2
EXIT_PARTIAL = 3
log = logging.getLogger("kvfleet.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="Ray-distributed inference for hybrid LLMs (full attention, sliding window, Mamba).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config_cmd = commands.add_parser("config", help="print the resolved configuration as YAML")
    _add_config_options(config_cmd)

    generate = commands.add_parser("generate", help="generate completions for prompts on the cluster (JSONL out)")
    _add_config_options(generate)
    generate.add_argument("prompts", nargs="*", help="prompts to complete")
    generate.add_argument(
        "--input", help='JSONL file, one {"prompt": text or token ids, "id"?, "max_tokens"?, ...} per line'
    )
    generate.add_argument("--output", help="write JSONL results here instead of stdout")
    _add_sampling_options(generate)
    generate.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API on Ray Serve until SIGINT/SIGTERM (then drain)"
    )
    _add_config_options(serve)
    serve.add_argument("--host", help="bind address (default: serve.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: serve.port, 8000)")
    return parser


def _add_config_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--config",
        default="local",
        help=f"preset name ({', '.join(available_presets())}) or path to a YAML file (default: local)",
    )
    cmd.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set workers.num_decode=2 (repeatable)",
    )


def _add_sampling_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    cmd.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    cmd.add_argument("--top-p", type=float, default=1.0)
    cmd.add_argument("--top-k", type=int, default=0)
    cmd.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    cmd.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    cmd.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        args.overrides = [*args.overrides, *_serve_overrides(args)]
    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        report_config_error("kvfleet", exc)
        return EXIT_BAD_CONFIG
    setup_logging(config.logging)
    if args.command == "config":
        sys.stdout.write(config_to_yaml(config))
        return 0
    if args.command == "serve":
        return _serve(config)
    return _generate(config, args)


def _serve_overrides(args: argparse.Namespace) -> list[str]:
    overrides = []
    if args.host is not None:
        overrides.append(f"serve.host={args.host}")
    if args.port is not None:
        overrides.append(f"serve.port={args.port}")
    return overrides


def _serve(config: ClusterConfig) -> int:
    from serving.launch import serve_until_signalled

    try:
        return serve_until_signalled(config)
    except Exception as exc:
        log.exception("serve failed")
        print(f"kvfleet: serve failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def report_config_error(prog: str, error: Exception) -> None:
    """Each problem of a config that cannot be used on its own line, e.g.
    ``kvfleet: invalid configuration: config: unknown preset 'nope' (available: local, tiny)``."""
    problems = error.problems if isinstance(error, ConfigError) else [f"config: {error}"]
    for line in problems:
        print(f"{prog}: invalid configuration: {line}", file=sys.stderr)


def sampling_from_args(args: argparse.Namespace) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _generate(config: ClusterConfig, args: argparse.Namespace) -> int:
    from cluster.jsonl import PromptItem, read_prompts
    from engine.validation import check_prompt

    entries: list[Any] = []
    try:
        defaults = sampling_from_args(args)
        entries += [PromptItem(check_prompt(p), defaults) for p in args.prompts]
        if args.input:
            entries += report_line_errors("kvfleet", read_prompts(args.input, defaults))
    except (ValueError, OSError) as exc:
        print(f"kvfleet: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not entries:
        print("kvfleet: generate needs at least one prompt (arguments or --input)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_items(config, entries, args.output, progress=not args.no_progress)


def report_line_errors(prog: str, entries: list[Any]) -> list[Any]:
    """Print ``file:line: <error>`` for each failed JSONL line in ``entries``; returns them."""
    from cluster.jsonl import LineError

    for entry in entries:
        if isinstance(entry, LineError):
            print(f"{prog}: {entry}", file=sys.stderr)
    return entries


def run_items(
    config: ClusterConfig, entries: Sequence[Any], output: str | None, *, progress: bool = True, prog: str = "kvfleet"
) -> int:
    """Start a cluster, run the prompts of ``entries`` (``PromptItem``; a ``LineError`` is a
    JSONL line that already failed), and write one JSONL record per entry in order: a result, or
    an error record. Prompts that fail the cluster's own checks (longer than the model's context,
    token ids outside its vocabulary) fail their line too. Returns the exit code (see above)."""
    from cluster.api import Cluster
    from cluster.jsonl import LineError, PromptItem, result_record, write_records

    entries = list(entries)
    completions: dict[int, Any] = {}
    try:
        if any(isinstance(e, PromptItem) for e in entries):
            with Cluster(config) as cluster:
                if not _reject_unfit(cluster, entries, prog):
                    return EXIT_BAD_INPUT
                runnable = {i: e for i, e in enumerate(entries) if isinstance(e, PromptItem)}
                completions = dict(zip(runnable, _run(cluster, list(runnable.values()), progress), strict=True))
                for index, outcome in completions.items():  # a request that failed fails its line
                    if isinstance(outcome, Exception):
                        if entries[index].line is None:  # a command-line prompt: the run failed
                            raise outcome
                        entries[index] = report_line_errors(
                            prog, [entries[index].rejected(f"request failed: {outcome}")]
                        )[0]
    except ValueError as exc:  # a bad prompt or sampling value: named field and value
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        log.exception("generation failed")
        print(f"{prog}: generation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    records = [
        entry.record() if isinstance(entry, LineError) else result_record(entry.id, completions[index])
        for index, entry in enumerate(entries)
    ]
    if output:
        with open(output, "w") as out:
            write_records(out, records)
    else:
        write_records(sys.stdout, records)
    failed = sum(isinstance(entry, LineError) for entry in entries)
    if failed:
        lines = sum(entry.line is not None for entry in entries)
        print(
            f"{prog}: {failed} of {lines} input lines failed; each has an error record in the output", file=sys.stderr
        )
        return EXIT_PARTIAL
    return 0


def _reject_unfit(cluster: Any, entries: list[Any], prog: str) -> bool:
    """Apply the cluster's own prompt checks, once: a prompt that passes is replaced by its
    ``ValidatedPrompt`` (``generate`` runs it as it is); a JSONL line that fails them becomes a
    LineError in ``entries`` (reported); a failing command-line prompt is reported and gives
    False."""
    from cluster.jsonl import PromptItem

    for index, entry in enumerate(entries):
        if not isinstance(entry, PromptItem):
            continue
        try:
            entries[index] = entry.checked(cluster.check_prompt(entry.prompt, entry.cache_salt))
        except ValueError as exc:
            if entry.line is None:
                print(f"{prog}: {exc}", file=sys.stderr)
                return False
            entries[index] = report_line_errors(prog, [entry.rejected(str(exc))])[0]
    return True


def _run(cluster: Any, items: list[Any], progress: bool) -> list[Any]:
    """Run ``items`` (PromptItem) on a started cluster; completions in the same order."""
    if not items:
        return []
    bar = _progress_bar(len(items)) if progress else None
    try:
        return cluster.generate(
            [item.prompt for item in items],
            [item.sampling for item in items],
            request_ids=_request_ids(items),
            on_completion=(lambda _: bar.update(1)) if bar is not None else None,
            return_exceptions=True,
        )
    finally:
        if bar is not None:
            bar.close()


def _request_ids(items: list[Any]) -> list[str] | None:
    ids = [item.id for item in items]
    if any(not i for i in ids) or len(set(ids)) != len(ids):
        return None  # ids are echoed in the output; requests get unique internal ids
    return ids


class _LogProgress:
    """Fallback progress: a log line per finished request (when tqdm is not installed)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        log.info("finished %d/%d", self.done, self.total)

    def close(self) -> None:
        pass


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _LogProgress(total)
    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr, leave=False)


if __name__ == "__main__":
    raise SystemExit(main())
