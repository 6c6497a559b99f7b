"""One module per ``streamrec`` subcommand, each with ``add_parser(sub)`` (its flags, beside its handler)
and ``run(args)`` or the handlers it registers. ``common.py`` holds what they share: exit codes, the
common flags, settings sources and summary output. A new subcommand is a new module listed in
:data:`COMMANDS`."""

from __future__ import annotations

from streamrec.commands import audit, counts, data, evaluate, join, monitor, refresh, replay, serve, stack, train

COMMANDS = (stack, data, replay, audit, join, counts, train, evaluate, refresh, serve, monitor)
