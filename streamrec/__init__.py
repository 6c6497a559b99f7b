"""The process edge: the ``streamrec`` command line, the settings loader and the local stack.

Owns: ``cli.py`` (one subcommand per job), ``settings.py`` (defaults < file < environment < flags),
``stack.py`` (a local broker and Redis for development and tests), ``demo.sh`` (``make demo``'s steps: replay,
join, train, refresh, serve with the monitor recording, then ``streamrec report``). Stages never import this package
for behaviour; it builds their configs and calls their entry points.
"""
