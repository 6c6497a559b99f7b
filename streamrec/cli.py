"""The ``streamrec`` command line: one console script, one subcommand per job (``streamrec/commands/``).

Each subcommand builds the typed settings of what it runs, here at the process edge (defaults < ``--config FILE`` <
``STREAMREC_<SECTION>_<KEY>`` < flags), and hands them down. Summaries print human-readable, or as one JSON object with
``--json`` (progress bars and logs go to stderr, so ``--json`` output can be piped). Every error of the exception tree
(``stream/errors.py``) ends as one line on stderr: exit 2 for a configuration mistake, 1 for a failure (also a stdout
whose reader left early, as ``| head`` does: no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from stream.secrets import RedactingArgumentParser, redact, warn_command_line_secrets
from streamrec.commands import COMMANDS, report
from streamrec.commands.common import EXIT_FAILED, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = RedactingArgumentParser(
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
    warn_command_line_secrets(given := list(sys.argv[1:] if argv is None else argv))  # a password in `ps`: said
    args, extra = (parser := build_parser()).parse_known_args(given)
    if extra:  # the command's parser says it (its usage), as its other errors; flags before the command: the top's
        early = given[:given.index(args.command)]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        (parser if early else sub).error(f"unrecognized arguments: {' '.join(early or extra)}")
    from confluent_kafka import KafkaException

    from stream.errors import ConfigError, StreamrecError, error_lines

    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader that left (`--json | head -c 100`) raises here, not at exit (status 120)
        return code
    except BrokenPipeError:  # no traceback; Python's flush at exit writes the rest to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (StreamrecError, KafkaException, TimeoutError) as exc:
        from stream.kafka_access import describe_error  # a broker that cannot be reached: which one, and the setting

        text = describe_error(exc) if isinstance(exc, KafkaException) else str(exc)
        print(f"streamrec {args.command}: error: {error_lines(redact(text))}", file=sys.stderr)  # escaped, bounded
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
