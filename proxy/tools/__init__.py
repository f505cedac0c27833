"""Tools built on the rest: the command line, bench, report, demo. Nothing imports them."""
