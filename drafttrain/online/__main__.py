"""`python -m drafttrain.online recipe=...`: the same entry point as drafttrain/online.py."""
from drafttrain.online.run import cli

cli()
