"""Command-line entry points: thin, sharing one argument module (:mod:`.args`)."""
