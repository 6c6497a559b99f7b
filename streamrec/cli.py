"""The ``streamrec`` command line: one console script, one subcommand per job (``streamrec/commands/``).

Settings come from defaults < ``--config FILE`` (TOML) < ``STREAMREC_<SECTION>_<KEY>`` environment
variables < flags; each subcommand builds the typed settings of the components it runs, here at the
process edge, and hands them down. Summaries print human-readable, or as one JSON object with
``--json`` (progress bars and logs go to stderr, so ``--json`` output can be piped). Every error of the
exception tree (``stream/errors.py``) ends as one line on stderr: exit 2 for a configuration mistake,
1 for a failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from streamrec.commands import COMMANDS, report
from streamrec.commands.common import EXIT_FAILED, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrec",
        description="Streaming online learning for click-through-rate ranking: replay and join events, "
        "train DeepFM continuously, refresh the hot-embedding cache, serve scores.",
        epilog="Every subcommand has --help. Start with: streamrec stack up && streamrec replay --dataset ml-1m",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (*COMMANDS, report):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from confluent_kafka import KafkaException

    from stream.errors import ConfigError, StreamrecError
    from stream.secrets import redact

    try:
        return int(args.func(args))
    except (StreamrecError, KafkaException, TimeoutError) as exc:
        from stream.kafka import describe_error  # a broker that cannot be reached: which one, and the setting

        text = describe_error(exc) if isinstance(exc, KafkaException) else str(exc)
        print(f"streamrec {args.command}: error: {redact(text)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
