"""Peer engines: setup.sh makes their venvs; the *_runner.py scripts run inside those venvs."""
